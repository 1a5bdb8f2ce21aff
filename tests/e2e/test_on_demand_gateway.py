"""Models on demand through real processes: `flatfare gateway` admits a request for a cold catalog model
that a fleet supervisor lists, and answers it once a `flatfare worker` of it comes up; a cold start that
never comes is withdrawn, free, with the fleet's reason; a LoRA variant is served by its base's worker.

The fleet is its heartbeat in Redis, as `flatfare fleet` writes it (contract item 8), so what is tested
here is the gateway's side alone; workers run the instant engine (no vLLM)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime

import httpx
import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare.contract import FleetStatus, Lane
from flatfare.redis_local import free_port
from tests.conftest import Stack, eventually, launch_stack, stop_process

pytestmark = pytest.mark.e2e

COLD = "e2e-cold"
BASE = "e2e-base"
VARIANT = "e2e-base-lora"
# A worker process's start (Python, the instant engine) on a loaded machine, and then some.
COME_UP_S = 120


@pytest.fixture(scope="module")
def ostack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(tmp_path_factory.mktemp("ondemand"), model="instant", worker_args=("--engine", "instant")) as s:
        for name, base in ((COLD, None), (BASE, None), (VARIANT, BASE)):
            s.sql("INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers, base_model) "
                  "VALUES (:name, 'builtin:none', '{}', true, false, 0, :base)", name=name, base=base)
        yield s


def _redis(stack: Stack) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(stack.redis_url)


def _fleet(stack: Stack, models: list[str], waiting: dict[str, str] | None = None) -> None:
    client = _redis(stack)
    try:
        status = FleetStatus(fleet_id="e2e-fleet", host="e2e", slots=["cpu"], models=models, waiting=waiting or {},
                             updated_ms=int(time.time() * 1000))
        client.set(contract.fleet_key("e2e-fleet"), status.encode(), ex=contract.FLEET_TTL_S * 100)
        # Far ahead: the fleet stays live for the whole test without a heartbeat loop here.
        client.zadd(contract.FLEETS_KEY, {"e2e-fleet": int(time.time() * 1000) + 3_600_000})
    finally:
        client.close()


def _no_fleet(stack: Stack) -> None:
    client = _redis(stack)
    try:
        client.delete(contract.FLEETS_KEY, contract.fleet_key("e2e-fleet"))
    finally:
        client.close()


def _queued(stack: Stack, pool: str) -> int:
    client = _redis(stack)
    try:
        return int(client.get(contract.queued_key(pool, Lane.STANDARD)) or 0)
    finally:
        client.close()


@contextmanager
def _worker(stack: Stack, model: str) -> Iterator[subprocess.Popen[bytes]]:
    log = (stack.logs / f"worker-{model}.log").open("ab")
    worker = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--engine", "instant", "--model", model],
                              env={**stack.env, "FLATFARE_INSTANT_START_DELAY_S": "1"}, cwd=stack.logs.parent,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        yield worker
    finally:
        stop_process(worker)
        log.close()


@contextmanager
def _gateway(stack: Stack, **env: str) -> Iterator[str]:
    """One more gateway process on the stack's Redis and database, with settings of its own."""
    port = free_port()
    log = (stack.logs / f"gateway-{port}.log").open("ab")
    gateway = subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", str(port)],
                               env={**stack.env, **env}, cwd=stack.logs.parent, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return gateway.poll() is not None  # ends the wait: asserted below
        eventually(up, bool, "the second gateway answers", timeout_s=120, every_s=0.2)
        assert gateway.poll() is None, (stack.logs / f"gateway-{port}.log").read_text()[-3000:]
        yield url
    finally:
        stop_process(gateway)
        log.close()


def _chat(stack: Stack, url: str, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=300,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra})


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_for_a_cold_model_is_answered_once_its_worker_comes_up(ostack: Stack, stream: bool) -> None:
    _fleet(ostack, [COLD])
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_chat, ostack, ostack.base_url, COLD, stream=stream)
            eventually(lambda: _queued(ostack, COLD), lambda n: n == 1, "the cold request queued", timeout_s=30)
            assert not waiting.done()
            with _worker(ostack, COLD):
                answered = waiting.result(timeout=COME_UP_S)
    finally:
        _no_fleet(ostack)
    assert answered.status_code == 200, answered.text
    assert int(answered.headers["x-flatfare-model-wait-ms"]) > 0
    if stream:
        assert answered.text.rstrip().endswith("data: [DONE]")
    (row,) = ostack.sql("SELECT billable, http_status FROM requests WHERE id = :id", id=answered.headers["x-request-id"])
    assert bool(row[0]) and row[1] == 200


def test_without_a_fleet_a_cold_model_is_refused_at_once(ostack: Stack) -> None:
    refused = _chat(ostack, ostack.base_url, COLD)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unavailable", refused.text
    assert "flatfare fleet" in refused.json()["error"]["message"]
    assert _queued(ostack, COLD) == 0


def test_a_cold_start_that_never_comes_is_withdrawn_and_free(ostack: Stack) -> None:
    why = "the start failed: CUDA out of memory"
    _fleet(ostack, [COLD], waiting={COLD: why})
    try:
        with _gateway(ostack, FLATFARE_COLD_START_TIMEOUT_S="2") as url:
            refused = _chat(ostack, url, COLD)
    finally:
        _no_fleet(ostack)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_cold_start_timeout" and why in error["message"]
    request_id = refused.headers["x-request-id"]
    (row,) = ostack.sql("SELECT billable, error_code, http_status FROM requests WHERE id = :id", id=request_id)
    assert not row[0] and row[1] == "model_cold_start_timeout" and row[2] == 503
    client = _redis(ostack)
    try:
        (account_id,) = ostack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0]
        day = quota_window("UTC", datetime.now(UTC)).day
        billable_today = ostack.sql("SELECT count(*) FROM requests WHERE account_id = :a AND billable AND quota_day = :d",
                                    a=account_id, d=day)[0][0]
        # The unit came back: the day's counter equals the account's billable rows.
        assert int(client.get(counter_key(account_id, day)) or 0) == billable_today
        assert client.zscore(contract.inflight_key(account_id), request_id) is None
        assert _queued(ostack, COLD) == 0
    finally:
        client.close()


def test_a_variant_is_served_by_its_base_s_worker_under_its_own_name(ostack: Stack) -> None:
    with _worker(ostack, BASE):
        answered = eventually(lambda: _chat(ostack, ostack.base_url, VARIANT), lambda r: r.status_code == 200,
                              "the variant answered by the base's worker", timeout_s=COME_UP_S, every_s=0.5)
    assert answered.json()["model"] == VARIANT
    (row,) = ostack.sql("SELECT model FROM requests WHERE id = :id", id=answered.headers["x-request-id"])
    assert row[0] == VARIANT
