"""Quotas, caps, idempotency and failures through four gateway processes and the instant engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest
import redis as redis_sync

from flatfare.billing.ledger import RETRY_S
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare import contract
from tests.conftest import eventually, launch_stack

pytestmark = pytest.mark.e2e

MODEL = "instant"
MESSAGES = [{"role": "user", "content": "hi"}]
PRO_PRICE_MICROS = 2000  # an operator's metered price on pro, set by the stack fixture


@pytest.fixture(scope="module")
def qstack(tmp_path_factory):
    env = {"FLATFARE_REQUEST_TIMEOUT_S": "4", "FLATFARE_AUTH_CACHE_TTL_S": "0.2",
           "FLATFARE_PLANS_CACHE_TTL_S": "0.2"}
    with launch_stack(tmp_path_factory.mktemp("quota"), model=MODEL, worker_args=("--engine", "instant"),
                      gateway_processes=4, env=env,
                      # The seeded plans have no per-request price (0010); the ledger and outbox checks need one.
                      before_start=(f"UPDATE plans SET price_per_request_micros = {PRO_PRICE_MICROS} "
                                    "WHERE name = 'pro'",)) as stack:
        yield stack


def _account(stack, name: str, plan: str = "pro", limit: int | None = None) -> tuple[int, str]:
    out = stack.cli("keys", "create", "--account", name, "--plan", plan)
    assert out.returncode == 0, out.stderr
    if limit is not None:
        stack.sql("UPDATE accounts SET daily_limit_override = :limit WHERE name = :name", limit=limit, name=name)
    account_id = stack.sql("SELECT id FROM accounts WHERE name = :name", name=name)[0][0]
    return account_id, out.stdout.strip()


def _counter(stack, account_id: int) -> int:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return int(client.get(counter_key(account_id, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()


def _wait_closed(stack, account_id: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.sql("SELECT count(*) FROM requests WHERE account_id = :a AND status = 'queued'", a=account_id)[0][0]:
        assert time.monotonic() < deadline, "ledger rows still open"
        time.sleep(0.1)


def _post(stack, key: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **headers})


async def test_200_concurrent_requests_through_4_gateways_at_a_quota_of_60(qstack) -> None:
    account_id, key = _account(qstack, "sixty", limit=60)
    # All 200 at once: only the daily quota may refuse here, not the plan's in-flight cap (16).
    qstack.sql("UPDATE accounts SET max_inflight_override = 1000 WHERE id = :a", a=account_id)
    async with httpx.AsyncClient(base_url=qstack.base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=200)) as client:
        async def one(i: int) -> int:
            body = {"model": MODEL, "messages": MESSAGES, "stream": i % 2 == 0}
            response = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            return response.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(200)))
    assert statuses.count(200) == 60 and statuses.count(429) == 140
    _wait_closed(qstack, account_id)
    assert _counter(qstack, account_id) == 60
    ledger = qstack.sql("SELECT count(*) FROM requests WHERE account_id = :a AND billable", a=account_id)[0][0]
    outbox = qstack.sql("SELECT count(*) FROM usage_outbox WHERE account_id = :a", a=account_id)[0][0]
    assert (ledger, outbox) == (60, 60)
    prices = qstack.sql("SELECT DISTINCT price_micros FROM requests WHERE account_id = :a", a=account_id)
    assert prices == [(PRO_PRICE_MICROS,)]  # the pro plan's flat price, whatever the length


def test_rate_limit_headers_and_the_429(qstack) -> None:
    _, key = _account(qstack, "two", limit=2)
    first = _post(qstack, key, {"model": MODEL, "messages": MESSAGES})
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    models = httpx.get(f"{qstack.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert models.headers["x-ratelimit-remaining-requests"] == "1"  # every /v1 response, counted or not
    assert _post(qstack, key, {"model": MODEL, "messages": MESSAGES}).status_code == 200
    refused = _post(qstack, key, {"model": MODEL, "messages": MESSAGES})
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) > 0
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "pro" in error["message"] and "2" in error["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_caps_refuse_before_counting(qstack) -> None:
    account_id, key = _account(qstack, "capped", plan="free")
    qstack.sql("UPDATE plans SET allowed_models = NULL WHERE name = 'free'")
    try:
        too_many = eventually(lambda: _post(qstack, key, {"model": MODEL, "messages": MESSAGES, "n": 2}),
                              lambda r: r.status_code != 403, "the plan's new models, past the plans cache",
                              in_a_row=20)  # every gateway process's cache
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        too_long = _post(qstack, key, {"model": MODEL, "messages": MESSAGES, "max_tokens": 100_000})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    finally:
        qstack.sql("UPDATE plans SET allowed_models = '[\"smollm2-135m-instruct\"]' WHERE name = 'free'")
    # Waited for with a request over the caps: refused, never counted, whichever plan the cache holds.
    eventually(lambda: _post(qstack, key, {"model": MODEL, "messages": MESSAGES, "n": 2}),
               lambda r: r.status_code == 403, "the plan's models restored, past the plans cache", in_a_row=20)
    outside = _post(qstack, key, {"model": MODEL, "messages": MESSAGES})
    assert outside.status_code == 403 and outside.json()["error"]["code"] == "model_not_allowed"
    assert _counter(qstack, account_id) == 0
    assert qstack.sql("SELECT count(*) FROM requests WHERE account_id = :a", a=account_id)[0][0] == 0


def test_suspended_account_gets_403(qstack) -> None:
    _, key = _account(qstack, "suspended")
    qstack.sql("UPDATE accounts SET status = 'suspended' WHERE name = 'suspended'")
    response = eventually(lambda: _post(qstack, key, {"model": MODEL, "messages": MESSAGES}),
                          lambda r: r.status_code != 200, "the suspension, past the auth cache")
    assert response.status_code == 403 and "suspended" in response.json()["error"]["message"]


def test_idempotent_retry_is_not_counted_or_charged_twice(qstack) -> None:
    account_id, key = _account(qstack, "idem")
    body = {"model": MODEL, "messages": MESSAGES}
    first = _post(qstack, key, body, **{"Idempotency-Key": "order-1"})
    again = _post(qstack, key, body, **{"Idempotency-Key": "order-1"})
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    streamed = _post(qstack, key, {**body, "stream": True}, **{"Idempotency-Key": "order-2"})
    replayed = _post(qstack, key, {**body, "stream": True}, **{"Idempotency-Key": "order-2"})
    assert streamed.text == replayed.text and streamed.text.endswith("data: [DONE]\n\n")
    conflict = _post(qstack, key, {**body, "max_tokens": 3}, **{"Idempotency-Key": "order-1"})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_key_reused"
    _wait_closed(qstack, account_id)
    assert _counter(qstack, account_id) == 2
    assert qstack.sql("SELECT count(*) FROM requests WHERE account_id = :a", a=account_id)[0][0] == 2


def test_an_idempotent_request_lost_with_its_gateway_runs_again_under_its_key(qstack) -> None:
    """A request whose gateway died before any answer was closed free by the reaper (gateway_lost):
    a retry with its key runs it again instead of answering 409. Simulated on the row and the reply
    stream the reaper leaves behind."""
    account_id, key = _account(qstack, "idem-lost")
    body = {"model": MODEL, "messages": MESSAGES}
    first = _post(qstack, key, body, **{"Idempotency-Key": "order-lost"})
    assert first.status_code == 200
    lost_id = first.headers["x-request-id"]
    _wait_closed(qstack, account_id)
    qstack.sql("UPDATE requests SET status = 'failed', billable = false, error_code = 'gateway_lost' "
               "WHERE id = :i", i=lost_id)
    client = redis_sync.Redis.from_url(qstack.redis_url)
    try:
        client.delete(contract.reply_stream(lost_id))
    finally:
        client.close()
    again = _post(qstack, key, body, **{"Idempotency-Key": "order-lost"})
    assert again.status_code == 200 and again.headers["x-request-id"] != lost_id
    _wait_closed(qstack, account_id)
    keys = dict(qstack.sql("SELECT id, idempotency_key FROM requests WHERE account_id = :a", a=account_id))
    assert keys == {lost_id: None, again.headers["x-request-id"]: "order-lost"}
    # An answer that exists is replayed as before, not run a third time.
    replayed = _post(qstack, key, body, **{"Idempotency-Key": "order-lost"})
    assert replayed.headers["x-request-id"] == again.headers["x-request-id"]


def test_a_ledger_that_cannot_record_the_request_answers_503_and_charges_nothing(qstack) -> None:
    """The row is written while the job runs; no answer may leave without it. If it cannot be written,
    the client gets 503, the unit comes back and nothing is recorded or charged."""
    account_id, key = _account(qstack, "no-ledger", limit=5)
    qstack.sql("ALTER TABLE requests RENAME TO requests_away")
    try:
        refused = _post(qstack, key, {"model": MODEL, "messages": MESSAGES})
    finally:
        qstack.sql("ALTER TABLE requests_away RENAME TO requests")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "ledger_unavailable"
    assert _counter(qstack, account_id) == 0
    # A process whose write just failed refuses requests for RETRY_S before counting them.
    time.sleep(RETRY_S)
    assert _post(qstack, key, {"model": MODEL, "messages": MESSAGES}).status_code == 200
    _wait_closed(qstack, account_id)
    assert _counter(qstack, account_id) == 1
    assert qstack.sql("SELECT count(*) FROM requests WHERE account_id = :a", a=account_id)[0][0] == 1
    assert qstack.sql("SELECT count(*) FROM usage_outbox WHERE account_id = :a", a=account_id)[0][0] == 1


def test_usage_endpoint(qstack) -> None:
    account_id, key = _account(qstack, "usage", limit=10)
    for _ in range(3):
        assert _post(qstack, key, {"model": MODEL, "messages": MESSAGES}).status_code == 200
    _wait_closed(qstack, account_id)
    usage = httpx.get(f"{qstack.base_url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["plan"] == "pro"
    assert (usage["today"]["requests"], usage["today"]["limit"], usage["today"]["remaining"]) == (3, 10, 7)
    assert usage["daily"] == [{"day": usage["today"]["day"], "model": MODEL, "requests": 3}]


def test_openai_sdk_sees_the_429(qstack) -> None:
    _, key = _account(qstack, "sdk", limit=1)
    client = openai.OpenAI(base_url=f"{qstack.base_url}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert caught.value.body["code"] == "rate_limit_exceeded"


def test_worker_killed_before_the_first_token_gives_the_unit_back(tmp_path) -> None:
    env = {"FLATFARE_REQUEST_TIMEOUT_S": "3", "FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "30"}
    with launch_stack(tmp_path, model=MODEL, worker_args=("--engine", "instant"), env=env) as stack:
        account_id = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
        key_id = stack.sql("SELECT id FROM api_keys WHERE account_id = :a", a=account_id)[0][0]
        key_counter = contract.key_quota_counter_key(key_id, quota_window("UTC", datetime.now(UTC)).day)
        client = redis_sync.Redis.from_url(stack.redis_url)
        counted: list[int] = []

        async def request_then_kill() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as http:
                pending = asyncio.ensure_future(http.post(
                    f"{stack.base_url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                    headers={"Authorization": f"Bearer {stack.api_key}"}))
                deadline = time.monotonic() + 10
                while not client.xpending(contract.job_stream(MODEL), contract.POOL_GROUP)["pending"]:
                    assert time.monotonic() < deadline, "the worker never took the job"
                    await asyncio.sleep(0.05)
                counted.append(int(client.get(key_counter) or 0))
                os.kill(stack.worker.pid, signal.SIGKILL)
                return await pending

        response = asyncio.run(request_then_kill())
        assert response.status_code == 504
        _wait_closed(stack, account_id)
        rows = stack.sql("SELECT status, billable FROM requests WHERE account_id = :a", a=account_id)
        assert rows == [("failed", False)]  # one row, not charged
        assert _counter(stack, account_id) == 0
        assert counted == [1] and int(client.get(key_counter) or 0) == 0  # the key's unit came back too
        client.close()
        assert stack.sql("SELECT count(*) FROM usage_outbox")[0][0] == 0


def test_jobs_lost_with_redis_data_are_answered_at_once_and_free(tmp_path) -> None:
    """Redis loses its data (FLUSHALL) with one job running on the worker and two queued behind it
    (one with an Idempotency-Key). The running one is answered (the worker says it still holds it);
    the queued ones get 503 job_lost within seconds, not at the request timeout, and cost nothing;
    the rebuilt counter equals the billable rows; the idempotent one runs again under its key."""
    env = {"FLATFARE_REQUEST_TIMEOUT_S": "60", "FLATFARE_LOST_JOB_AFTER_S": "1.5", "FLATFARE_JOB_LEASE_S": "1.5",
           "FLATFARE_MAX_INFLIGHT": "1", "FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "5"}
    with launch_stack(tmp_path, model=MODEL, worker_args=("--engine", "instant"), env=env) as stack:
        account_id = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
        client = redis_sync.Redis.from_url(stack.redis_url)
        body = {"model": MODEL, "messages": MESSAGES}
        headers = {"Authorization": f"Bearer {stack.api_key}"}

        async def three_then_flush() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, headers=headers) as http:
                sent = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body,
                                                        headers={"Idempotency-Key": "lost-1"} if i == 2 else {}))
                        for i in range(3)]
                stream = contract.job_stream(MODEL)
                deadline = time.monotonic() + 10
                waiting = contract.queued_key(MODEL, contract.Lane.STANDARD)
                while not (int(client.get(waiting) or 0) == 2
                           and client.xpending(stream, contract.POOL_GROUP)["pending"] == 1):
                    assert time.monotonic() < deadline, "the jobs were never queued"
                    await asyncio.sleep(0.05)
                client.flushall()
                return list(await asyncio.gather(*sent))

        started = time.monotonic()
        answers = asyncio.run(three_then_flush())
        assert time.monotonic() - started < 30  # not the 60 s request timeout
        codes = sorted(str(a.status_code) if a.status_code == 200 else a.json()["error"]["code"] for a in answers)
        assert codes == ["200", "job_lost", "job_lost"], [a.text for a in answers]
        _wait_closed(stack, account_id)
        rows = stack.sql("SELECT billable, error_code FROM requests WHERE account_id = :a", a=account_id)
        assert sorted(rows, key=str) == sorted([(True, None), (False, "job_lost"), (False, "job_lost")], key=str)

        # The next request rebuilds the counters from the ledger: the one answered, then itself.
        # The idempotent one runs again under its key (it was lost free, before any answer).
        again = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60,
                           headers={**headers, "Idempotency-Key": "lost-1"})
        assert again.status_code == 200, again.text
        _wait_closed(stack, account_id)
        assert _counter(stack, account_id) == 2
        assert stack.sql("SELECT count(*) FROM requests WHERE account_id = :a AND billable", a=account_id)[0][0] == 2
        client.close()
