"""The lane queue's admission script (flatfare.lanes.admit) against a real redis-server: every refusal
leaves nothing behind (no unit, nothing in flight, no job); counters lost with Redis's data are not
trusted; a job no worker was given yet is taken back once. The gateway's side of it (backpressure,
the refusals' answers, the rebuild): tests/gateway/jobpath/test_queueing.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.lanes.admit import KeySighting, QuotaClaim, Verdict, admit, withdraw

POOL = "m"
HOLDER = contract.held_units("g")


def _claim(limit: int | None = None, *, key_id: int | None = 7, key_limit: int | None = None,
           max_inflight: int | None = None) -> QuotaClaim:
    window = quota_window("UTC", datetime.now(UTC))
    return QuotaClaim(1, window.day, limit, expiry(window.resets_at), key_id, key_limit, max_inflight)


async def _admit(redis, i: int, claim: QuotaClaim, max_depth: int = 100):
    job = Job(f"r{i}", Endpoint.CHAT, "{}", 0, lane=Lane.STANDARD, account_id=1)
    return await admit(redis, job, POOL, claim, holder=HOLDER, held=f"1:{claim.day}:7", max_depth=max_depth)


async def _left_behind(redis, claim: QuotaClaim) -> tuple[int, int, int, int, int]:
    """(account's count, key's count, in flight, held, queued)."""
    return (int(await redis.get(contract.quota_counter_key(1, claim.day)) or 0),
            int(await redis.get(contract.key_quota_counter_key(7, claim.day)) or 0),
            await redis.zcard(contract.inflight_key(1)), await redis.hlen(HOLDER),
            int(await redis.get(contract.queued_key(POOL, Lane.STANDARD)) or 0))


async def test_without_the_epoch_marker_nothing_is_counted(redis) -> None:
    claim = _claim()
    assert (await _admit(redis, 0, claim)).verdict is Verdict.REBUILDING
    assert await _left_behind(redis, claim) == (0, 0, 0, 0, 0)


async def test_each_refusal_leaves_nothing_behind(redis) -> None:
    await redis.set(contract.QUOTA_EPOCH_KEY, "gen-1")
    admitted = await _admit(redis, 0, _claim())
    assert (admitted.verdict, admitted.used, admitted.key_used, admitted.generation) == (Verdict.ADMITTED, 1, 1,
                                                                                          "gen-1")
    for claim, max_depth, verdict in ((_claim(1), 100, Verdict.QUOTA_SPENT),
                                      (_claim(key_limit=1), 100, Verdict.KEY_QUOTA_SPENT),
                                      (_claim(max_inflight=1), 100, Verdict.ACCOUNT_BUSY),
                                      (_claim(), 1, Verdict.LANE_FULL)):
        assert (await _admit(redis, 1, claim, max_depth)).verdict is verdict
        assert await _left_behind(redis, claim) == (1, 1, 1, 1, 1), verdict


async def test_the_quota_is_exact_under_concurrency(redis) -> None:
    await redis.set(contract.QUOTA_EPOCH_KEY, "gen-1")
    claim = _claim(10)
    answers = await asyncio.gather(*(_admit(redis, i, claim) for i in range(50)))
    assert sorted(a.used for a in answers if a.verdict is Verdict.ADMITTED) == list(range(1, 11))
    assert await _left_behind(redis, claim) == (10, 10, 10, 10, 10)


async def test_a_waiting_job_is_withdrawn_once(redis) -> None:
    await redis.set(contract.QUOTA_EPOCH_KEY, "gen-1")
    queued = (await _admit(redis, 0, _claim())).queued
    assert queued is not None and queued.lane is Lane.STANDARD
    assert await withdraw(redis, queued)
    assert not await withdraw(redis, queued)
    assert int(await redis.get(contract.queued_key(POOL, Lane.STANDARD))) == 0
    assert await redis.llen(contract.lane_ring(POOL, Lane.STANDARD)) == 0


def _seen(address: str, *, alert_at: int | None = None, max_addresses: int | None = None) -> KeySighting:
    return KeySighting(address, f"agent-{address}", "2026-12-06", 3600, alert_at, max_addresses, 600_000)


async def test_a_key_is_listed_past_its_alert_threshold_and_refused_past_its_addresses_at_once(redis) -> None:
    """Shared-key detection: each admitted request adds its client's address and user agent to the key's
    day; past the plan's threshold the key is listed as shared; with a cap, a request from yet another
    address is refused and leaves nothing behind, not even its sighting."""
    await redis.set(contract.QUOTA_EPOCH_KEY, "gen-1")
    addresses, shared = contract.key_addresses_key(7, "2026-12-06"), contract.shared_keys_key("2026-12-06")
    for i, address in enumerate(["a1", "a2", "a2", "a3"]):
        claim = replace(_claim(), sighting=_seen(address, alert_at=3, max_addresses=3))
        assert (await _admit(redis, i, claim)).verdict is Verdict.ADMITTED
    assert await redis.pfcount(addresses) == 3
    assert await redis.pfcount(contract.key_agents_key(7, "2026-12-06")) == 3
    assert not await redis.smembers(shared), "3 addresses is not past a threshold of 3"
    assert 0 < await redis.ttl(addresses) <= 3600

    refused = replace(_claim(), sighting=_seen("a4", alert_at=3, max_addresses=3))
    answer = await _admit(redis, 9, refused)
    assert (answer.verdict, answer.inflight) == (Verdict.KEY_SHARED, 3)
    assert await _left_behind(redis, refused) == (4, 4, 4, 4, 4)
    assert await redis.pfcount(addresses) == 3
    # One of the addresses already seen still gets in; without the cap a fourth does, and lists the key.
    assert (await _admit(redis, 10, replace(_claim(), sighting=_seen("a1", max_addresses=3)))).verdict \
        is Verdict.ADMITTED
    assert (await _admit(redis, 11, replace(_claim(), sighting=_seen("a4", alert_at=3)))).verdict \
        is Verdict.ADMITTED
    assert await redis.smembers(shared) == {b"7"}
