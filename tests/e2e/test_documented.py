"""What README.md and docs/ promise and no other test showed, each through the running platform:
a gateway, Redis, SQLite, and workers of their own per test (the instant engine, slowed down, serving
a model of the test's own, so its delays and switches touch nothing else); vLLM's ids on the real
CPU engine (the shared ``stack``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync
from aiohttp import web

from bench.stripe_edge import StripeEdge
from flatfare import contract
from flatfare.billing import outbox
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from tests.conftest import Stack, eventually, launch_stack, stop_process

pytestmark = pytest.mark.e2e

# The gateway's FLATFARE_REQUEST_TIMEOUT_S in this module: short, so a timeout is quick to reach, and
# longer than every answer the tests wait for (their slow workers take 2-3 s).
TIMEOUT_S = 6
# Pro metered per request, as an operator may price it.
PRO_PRICED = "UPDATE plans SET price_per_request_micros = 2000 WHERE name = 'pro'"
DAY_S = 24 * 3600


@pytest.fixture(scope="module")
def dstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"FLATFARE_REQUEST_TIMEOUT_S": str(TIMEOUT_S), "FLATFARE_AUTH_CACHE_TTL_S": "0.1",
           "FLATFARE_POOLS_CACHE_TTL_S": "0.1"}
    # The seeded plans are flat (0010); the outbox checks need pro priced per request, as an operator may.
    with launch_stack(tmp_path_factory.mktemp("documented"), model="instant", worker_args=("--engine", "instant"),
                      env=env, before_start=(PRO_PRICED,)) as stack:
        yield stack


def _until(predicate: Callable[[], object], what: str, timeout_s: float = 20) -> None:
    eventually(predicate, bool, what, timeout_s=timeout_s)


async def _until_async(predicate: Callable[[], object], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _redis(stack: Stack) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(stack.redis_url)


def _live(stack: Stack, pool: str) -> list[contract.WorkerInfo]:
    with _redis(stack) as client:
        oldest = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        ids = client.zrangebyscore(contract.pool_key(pool), oldest, "+inf")
        infos = [client.hgetall(contract.worker_key(i.decode())) for i in ids]
    return [contract.WorkerInfo.from_fields(f) for f in infos if f]


@contextmanager
def _worker(stack: Stack, model: str, *, log_prompts: bool = False, **env: str) -> Iterator[Path]:
    """One instant-engine worker (one job at a time) serving ``model`` alone; yields its log file once
    the gateway routes to it."""
    log = stack.logs / f"worker-{model}.log"
    full_env = {k: v for k, v in stack.env.items() if k != "FLATFARE_LOG_PROMPTS"}
    if log_prompts:
        full_env["FLATFARE_LOG_PROMPTS"] = "true"
    process = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--engine", "instant", "--model", model,
                                "--max-inflight", "1"], env={**full_env, **env}, stdout=log.open("wb"),
                               stderr=subprocess.STDOUT)
    try:
        def routed() -> bool:
            assert process.poll() is None, log.read_text()[-3000:]
            models = httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {stack.api_key}"})
            return any(m["id"] == model and m.get("state", "warm") == "warm" for m in models.json()["data"])

        _until(routed, f"the {model} worker never became warm", timeout_s=60)
        yield log
    finally:
        stop_process(process)


def _account(stack: Stack, name: str) -> tuple[int, str]:
    out = stack.cli("keys", "create", "--account", name, "--plan", "pro")
    assert out.returncode == 0, out.stderr
    return stack.sql("SELECT id FROM accounts WHERE name = :n", n=name)[0][0], out.stdout.strip()


def _used(stack: Stack, account_id: int) -> int:
    with _redis(stack) as client:
        return int(client.get(counter_key(account_id, quota_window("UTC", datetime.now(UTC)).day)) or 0)


def _rows(stack: Stack, account_id: int) -> dict[str, tuple]:
    rows = stack.sql("SELECT id, status, http_status, billable, error_code FROM requests WHERE account_id = :a",
                     a=account_id)
    return {row[0]: tuple(row[1:]) for row in rows}


def _all_closed(stack: Stack, account_id: int) -> bool:
    return all(status != "queued" for status, *_ in _rows(stack, account_id).values())


def _queue(stack: Stack, model: str) -> tuple[int, int]:
    """(jobs on the model's standard lane, waiting or held by a worker; of which a worker holds)."""
    stream = contract.job_stream(model)
    with _redis(stack) as client:
        waiting = int(client.get(contract.queued_key(model, contract.Lane.STANDARD)) or 0)
        held = client.xpending(stream, contract.POOL_GROUP)["pending"] if client.exists(stream) else 0
        return waiting + held, held


def _chat(model: str, content: str, **fields: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def _log_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _said(path: Path, text: str) -> bool:
    return any(text in line.get("message", "") for line in _log_lines(path))


# -- README "Failed requests are free": a client gone while queued; ARCHITECTURE: the worker skips it --

async def test_a_client_gone_while_its_job_is_queued_is_not_charged_and_its_job_is_skipped(dstack: Stack) -> None:
    model = "doc-gone"
    account_id, key = _account(dstack, "doc-gone")
    auth = {"Authorization": f"Bearer {key}"}
    with _worker(dstack, model, log_prompts=True, FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S="3") as log:
        async with httpx.AsyncClient(base_url=dstack.base_url, timeout=30, headers=auth) as http, \
                httpx.AsyncClient(base_url=dstack.base_url, timeout=30, headers=auth) as leaving:
            busy = asyncio.ensure_future(http.post("/v1/chat/completions", json=_chat(model, "busy")))
            await _until_async(lambda: _queue(dstack, model) == (1, 1), "the worker never took the first job")
            gone = asyncio.ensure_future(leaving.post("/v1/chat/completions", json=_chat(model, "gone")))
            await _until_async(lambda: _queue(dstack, model) == (2, 1), "the second job was never queued")
            gone.cancel()  # the client goes away: its connection closes
            await leaving.aclose()
            await _until_async(lambda: "cancelled" in {r[0] for r in _rows(dstack, account_id).values()},
                               "the gateway never closed the row of the request whose client left")
            assert not busy.done(), "the first job ended before the second's client left: nothing was queued"
            answered = await busy
        assert answered.status_code == 200
        busy_id = answered.headers["x-request-id"]
        (gone_id,) = [i for i, row in _rows(dstack, account_id).items() if row[0] == "cancelled"]
        _until(lambda: _said(log, f"skipping {gone_id}"), "the worker never skipped the job whose client left")
        _until(lambda: _all_closed(dstack, account_id), "ledger rows still open")
        _until(lambda: _queue(dstack, model) == (0, 0), "the skipped job was never acknowledged")
    rows = _rows(dstack, account_id)
    assert rows[gone_id][0] == "cancelled" and not rows[gone_id][2]  # closed free
    assert _used(dstack, account_id) == 1  # the unit of the request that left came back
    assert dstack.sql("SELECT request_id FROM usage_outbox WHERE account_id = :a", a=account_id) == [(busy_id,)]
    # The engine never saw it: its prompt, logged for every job that runs (FLATFARE_LOG_PROMPTS), is not there.
    assert _said(log, f"prompt of {busy_id}") and not _said(log, f"prompt of {gone_id}")


# -- ARCHITECTURE "Deadlines": a worker that claims a job past its deadline answers 429 without running it --

async def test_a_worker_skips_a_job_whose_deadline_passed(dstack: Stack) -> None:
    """The gateway withdraws a job at its deadline if no worker has it; the worker's own check is for
    a job it gets late anyway. Here the gateway is stopped (SIGSTOP) past the deadline, so it cannot
    withdraw the job, and the worker meets it late."""
    model = "doc-deadline"
    account_id, key = _account(dstack, "doc-deadline")
    auth = {"Authorization": f"Bearer {key}"}
    with _worker(dstack, model, log_prompts=True, FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S="2") as log:
        async with httpx.AsyncClient(base_url=dstack.base_url, timeout=30, headers=auth) as http:
            busy = asyncio.ensure_future(http.post("/v1/chat/completions", json=_chat(model, "busy")))
            await _until_async(lambda: _queue(dstack, model) == (1, 1), "the worker never took the first job")
            late = asyncio.ensure_future(http.post("/v1/chat/completions", json=_chat(model, "late"),
                                                   headers={"x-flatfare-max-queue-ms": "800"}))
            await _until_async(lambda: _queue(dstack, model) == (2, 1), "the second job was never queued")
            os.kill(dstack.gateway.pid, signal.SIGSTOP)
            try:
                await _until_async(lambda: _queue(dstack, model) == (0, 0), "the worker never ended the late job")
            finally:
                os.kill(dstack.gateway.pid, signal.SIGCONT)
            answered, refused = await asyncio.gather(busy, late)
    assert answered.status_code == 200
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_deadline_exceeded"
    # The worker's answer, not the gateway's: it says when the worker took the job, past the deadline.
    assert int(refused.headers["x-flatfare-queue-ms"]) >= 800
    late_id = refused.headers["x-request-id"]
    _until(lambda: _all_closed(dstack, account_id), "ledger rows still open")
    assert _rows(dstack, account_id)[late_id][:2] == ("failed", 429)
    assert not _rows(dstack, account_id)[late_id][2]  # not billable
    assert _used(dstack, account_id) == 1
    assert _said(log, f"prompt of {answered.headers['x-request-id']}") and not _said(log, f"prompt of {late_id}")


# -- README "Errors": a timeout (the job is cancelled, its ledger row closed and its unit given back) --

def test_a_timeout_cancels_the_job(dstack: Stack) -> None:
    model = "doc-timeout"
    account_id, key = _account(dstack, "doc-timeout")
    with _worker(dstack, model, FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S="120") as log:
        started = time.monotonic()
        response = httpx.post(f"{dstack.base_url}/v1/chat/completions", json=_chat(model, "slow"),
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started >= TIMEOUT_S
        _until(lambda: _all_closed(dstack, account_id), "the timed-out row was never closed")
        ((request_id, row),) = _rows(dstack, account_id).items()
        # The worker aborts the engine request at once, not when its answer would have come (120 s).
        _until(lambda: _said(log, f"aborting {request_id}"), "the worker never cancelled the timed-out job")
        _until(lambda: _queue(dstack, model) == (0, 0), "the cancelled job was never acknowledged")
        _until(lambda: all(w.inflight == 0 for w in _live(dstack, model)), "the worker still holds the job")
    assert row[:2] == ("failed", 504) and not row[2] and row[3] == "timeout"
    assert _used(dstack, account_id) == 0
    assert dstack.sql("SELECT count(*) FROM usage_outbox WHERE account_id = :a", a=account_id) == [(0,)]


# -- README "Idempotent retries": followed live while the first is still running; ARCHITECTURE: kept 24 h --

async def _stream(http: httpx.AsyncClient, body: dict, headers: dict[str, str],
                  on_line: Callable[[int], None] = lambda _n: None) -> tuple[httpx.Response, list[tuple[float, str]]]:
    lines: list[tuple[float, str]] = []
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if line:
                lines.append((time.monotonic(), line))
                on_line(len(lines))
    return response, lines


async def test_an_idempotent_retry_follows_the_first_request_live(dstack: Stack) -> None:
    model = "doc-follow"
    account_id, key = _account(dstack, "doc-follow")
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "follow-1"}
    body = _chat(model, "tell me", stream=True)
    with _worker(dstack, model, FLATFARE_INSTANT_TOKEN_DELAY_S="0.15"):  # 16 tokens: about 2.3 s
        async with httpx.AsyncClient(base_url=dstack.base_url, timeout=30) as http:
            joined = asyncio.Event()
            first = asyncio.ensure_future(_stream(http, body, headers, lambda n: n == 3 and joined.set()))
            await asyncio.wait_for(joined.wait(), 20)
            retry_response, retry_lines = await _stream(http, body, headers)
            first_response, first_lines = await first
    assert first_response.status_code == retry_response.status_code == 200
    assert retry_response.headers["x-request-id"] == first_response.headers["x-request-id"]
    # The same stream, whole, from its first chunk ...
    assert [line for _, line in retry_lines] == [line for _, line in first_lines]
    assert first_lines[-1][1] == "data: [DONE]" and len(first_lines) > 10
    # ... followed live: the retry had chunks before the first request's stream ended, and got the
    # first request's later chunks as they came, not all at once at the end.
    first_done = first_lines[-1][0]
    assert retry_lines[0][0] < first_done
    assert retry_lines[-1][0] - retry_lines[0][0] > 0.5
    _until(lambda: _all_closed(dstack, account_id), "ledger rows still open")
    assert len(_rows(dstack, account_id)) == 1 and _used(dstack, account_id) == 1


def test_idempotent_reply_streams_are_kept_24_hours(dstack: Stack) -> None:
    account_id, key = _account(dstack, "doc-ttl")
    auth = {"Authorization": f"Bearer {key}"}
    kept = httpx.post(f"{dstack.base_url}/v1/chat/completions", json=_chat("instant", "keep"), timeout=30,
                      headers={**auth, "Idempotency-Key": "ttl-1"})
    plain = httpx.post(f"{dstack.base_url}/v1/chat/completions", json=_chat("instant", "plain"), timeout=30,
                       headers=auth)
    assert kept.status_code == plain.status_code == 200
    with _redis(dstack) as client:
        stream = contract.reply_stream(kept.headers["x-request-id"])
        # Once the request has finished (its row closed), its stream lives 24 h, not the 600 s of a running one.
        _until(lambda: client.ttl(stream) > contract.REPLY_TTL_S, "the reply stream's TTL was never raised")
        assert DAY_S - 120 < client.ttl(stream) <= DAY_S
        assert client.xlen(stream) >= 1
        # A request without a key leaves no stream of its own.
        assert not client.exists(contract.reply_stream(plain.headers["x-request-id"]))
    replay = httpx.post(f"{dstack.base_url}/v1/chat/completions", json=_chat("instant", "keep"), timeout=30,
                        headers={**auth, "Idempotency-Key": "ttl-1"})
    assert replay.json() == kept.json()
    assert _used(dstack, account_id) == 2


# -- OPERATIONS "Logs": FLATFARE_LOG_PROMPTS=true logs each job's prompt on the worker; never otherwise --

def test_prompts_reach_the_logs_only_when_switched_on(dstack: Stack) -> None:
    _, key = _account(dstack, "doc-prompts")
    on_marker, off_marker = f"zebra-{uuid.uuid4().hex}", f"okapi-{uuid.uuid4().hex}"
    with _worker(dstack, "doc-prompts-on", log_prompts=True) as on_log, _worker(dstack, "doc-prompts-off") as off_log:
        answers = {}
        for model, marker in (("doc-prompts-on", on_marker), ("doc-prompts-off", off_marker)):
            response = httpx.post(f"{dstack.base_url}/v1/chat/completions", json=_chat(model, f"my secret {marker}"),
                                  headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert response.status_code == 200
            answers[marker] = response.headers["x-request-id"]
        gateway_log = dstack.logs / "gateway.log"
        # The gateway's line for each request is written once its bookkeeping is done: wait for both.
        _until(lambda: {line.get("request_id") for line in _log_lines(gateway_log)} >= set(answers.values()),
               "the gateway never logged the two requests")
    on_lines = [line for line in _log_lines(on_log) if line.get("request_id") == answers[on_marker]]
    assert any(on_marker in json.dumps(line.get("prompt")) for line in on_lines), on_lines
    assert any("output" in line for line in on_lines)
    everything_else = off_log.read_text() + gateway_log.read_text()
    assert off_marker not in everything_else and on_marker not in gateway_log.read_text()
    assert not any("prompt" in line or "output" in line for line in _log_lines(off_log))


# -- ARCHITECTURE "The contract": vLLM's ids (chatcmpl-{id}) match the gateway's x-request-id --

def test_vllm_ids_are_the_gateways_request_id(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    raw = client.chat.completions.with_raw_response.create(model=stack.model, messages=question, max_tokens=4)
    assert raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"
    with client.chat.completions.with_streaming_response.create(model=stack.model, messages=question, max_tokens=4,
                                                                stream=True) as streamed:
        ids = {chunk.id for chunk in streamed.parse()}
        assert ids == {f"chatcmpl-{streamed.headers['x-request-id']}"}
    assert raw.headers["x-request-id"] != streamed.headers["x-request-id"]


# -- README "Payments": meter events leave from the outbox; one gateway process sends at a time --

class _SlowMeter(StripeEdge):
    """Stripe's edge, each meter event taking a while: two senders at once would overlap here."""

    def __init__(self, call_s: float) -> None:
        super().__init__()
        self.call_s = call_s
        self.in_flight = 0
        self.most_in_flight = 0

    async def _meter_event(self, request: web.Request, form: dict[str, str]) -> web.Response:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.call_s)
            return await super()._meter_event(request, form)
        finally:
            self.in_flight -= 1


# Every process polls the outbox five times a second, so its lease lasts 5 s; 16 meter events, 8 calls at
# once (outbox.CONCURRENCY), take 0.3 s to send at 0.15 s each, and 6 s, longer than the lease, at 3 s each.
@pytest.mark.parametrize("call_s", [0.15, 3.0])
def test_one_gateway_process_sends_the_outbox_at_a_time(tmp_path: Path, call_s: float) -> None:
    edge = _SlowMeter(call_s).start()
    env = {"FLATFARE_STRIPE_API_KEY": "sk_test_flatfare", "FLATFARE_STRIPE_WEBHOOK_SECRET": "whsec_flatfare_test",
           "FLATFARE_STRIPE_API_BASE": edge.url, "FLATFARE_STRIPE_PRICES": json.dumps({"pro": "price_pro"}),
           "FLATFARE_BILLING_OUTBOX_INTERVAL_S": "0.2"}
    try:
        # Pro metered (0010 seeds flat plans) before the gateway starts: its plans cache never saw it free.
        with launch_stack(tmp_path, model="instant", worker_args=("--engine", "instant"), gateway_processes=3,
                          env=env, before_start=(PRO_PRICED,)) as stack:
            stack.sql("UPDATE accounts SET stripe_customer_id = 'cus_outbox' WHERE name = 'e2e'")
            with httpx.Client(base_url=stack.base_url, timeout=30,
                              headers={"Authorization": f"Bearer {stack.api_key}"}) as http:
                ids = []
                for i in range(16):
                    response = http.post("/v1/chat/completions", json=_chat("instant", f"n{i}"))
                    assert response.status_code == 200
                    ids.append(response.headers["x-request-id"])
            _until(lambda: stack.sql("SELECT count(*) FROM usage_outbox WHERE status = 'sent'") == [(16,)],
                   "the outbox was never sent", timeout_s=60)
            with _redis(stack) as client:
                leader = client.get(contract.OUTBOX_LEADER_KEY)
    finally:
        edge.stop()
    assert sorted(edge.deliveries) == sorted(ids) and set(edge.deliveries.values()) == {1}
    # One sender's group at most: two senders would have had the same due rows in flight together.
    assert edge.most_in_flight <= outbox.CONCURRENCY, f"{edge.most_in_flight} meter events were in flight at once"
    assert leader is not None
