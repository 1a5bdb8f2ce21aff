"""Every Redis key and the error envelope are the contract's: spelled once, there, and unchanged in value
(a gateway or worker of the previous release shares the same Redis during a rolling upgrade)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.gateway.errors import ErrorEnvelope
from flatfare.gateway.errors import error_body as gateway_error_body
from flatfare.workers import engine, loop

REPO = Path(__file__).resolve().parents[3]
# A Redis key spelled out by hand: a string (plain or f-) that starts with the contract's prefix.
_SPELLED_KEY = re.compile(r"""["']ff:""")


def test_no_module_outside_the_contract_spells_a_redis_key() -> None:
    sources = [path for folder in ("gateway", "workers", "billing", "fleet", "flatfare")
               for path in (REPO / folder).rglob("*.py")]
    assert len(sources) > 50
    spelled = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
               for path in sources if path != REPO / "flatfare" / "contract" / "keys.py"
               for number, line in enumerate(path.read_text().splitlines(), 1) if _SPELLED_KEY.search(line)]
    assert spelled == [], "name these keys in flatfare/contract/keys.py (the console's: its keyspace.py) and import them"


def test_the_quota_grammar_and_outbox_keys_keep_their_names() -> None:
    assert contract.QUOTA_EPOCH_KEY == "ff:quota:epoch"
    assert contract.QUOTA_REBUILD_LOCK_KEY == "ff:quota:rebuilding"
    assert contract.quota_counter_key(7, "2026-12-03") == "ff:quota:7:2026-12-03"
    assert contract.grammars_key(7) == "ff:grammars:7"
    assert contract.OUTBOX_LEADER_KEY == "ff:billing:outbox-leader"


async def test_a_days_counter_pattern_finds_that_days_counters_only(redis: aioredis.Redis) -> None:
    day, other = "2026-12-03", "2026-12-04"
    counters = {contract.quota_counter_key(account, day).encode() for account in (1, 22, 333)}
    others = [contract.quota_counter_key(1, other), contract.QUOTA_EPOCH_KEY, contract.QUOTA_REBUILD_LOCK_KEY,
              contract.grammars_key(1), contract.OUTBOX_LEADER_KEY]
    for key in [*counters, *others]:
        await redis.set(key, 1)
    assert {key async for key in redis.scan_iter(match=contract.quota_counter_key("*", day))} == counters


async def test_the_accounts_and_the_keys_day_counters_never_match_each_others_pattern(redis: aioredis.Redis) -> None:
    """A rebuild replaces each kind by its own pattern, and the money audit sums the accounts' counters
    alone: a key's counter under the accounts' pattern would be counted twice."""
    day = "2026-12-03"
    accounts = {contract.quota_counter_key(account, day).encode() for account in (1, 22)}
    keys = {contract.key_quota_counter_key(key_id, day).encode() for key_id in (1, 22)}
    for key in [*accounts, *keys]:
        await redis.set(key, 1)
    assert {key async for key in redis.scan_iter(match=contract.quota_counter_key("*", day))} == accounts
    assert {key async for key in redis.scan_iter(match=contract.quota_counter_key("*", "*"))} == accounts
    assert {key async for key in redis.scan_iter(match=contract.key_quota_counter_key("*", day))} == keys
    assert contract.key_quota_counter_key(7, day) == "ff:keyquota:7:2026-12-03"


def test_every_error_builder_writes_the_one_envelope() -> None:
    bodies = [
        gateway_error_body(404, "no such model", param="model", code="model_not_found"),
        json.loads(loop._error(502, "worker lost", "worker_lost").data),
        engine._error(400, "bad value", "temperature"),
    ]
    for body in bodies:
        assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
        ErrorEnvelope.model_validate(body)
    assert bodies[0] == contract.error_body("no such model", "not_found_error", "model", "model_not_found")
    assert bodies[1] == contract.error_body("worker lost", "server_error", code="worker_lost")
    assert bodies[2] == contract.error_body("bad value", "invalid_request_error", "temperature")
