"""Scheduling with real workers (the instant engine, slowed down): lanes, backpressure, deadlines,
worker death, draining, warmth."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest
import redis as redis_sync

from bench.stripe_edge import Answer, StripeEdge
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare import contract
from flatfare.contract import Lane
from tests.conftest import eventually, launch_stack

pytestmark = pytest.mark.e2e

MODEL = "instant"
MESSAGES = [{"role": "user", "content": "hi"}]


def _worker(stack, *args: str, **env: str) -> subprocess.Popen[bytes]:
    log = (stack.logs / f"worker-{len(list(stack.logs.iterdir()))}.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--engine", "instant", "--model", MODEL,
                             *args], env={**stack.env, **env}, stdout=log, stderr=subprocess.STDOUT)


def _key(stack, name: str, plan: str) -> str:
    out = stack.cli("keys", "create", "--account", name, "--plan", plan)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _redis(stack) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(stack.redis_url)


def _live(stack, pool: str = MODEL) -> list[contract.WorkerInfo]:
    client = _redis(stack)
    try:
        oldest = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        ids = client.zrangebyscore(contract.pool_key(pool), oldest, "+inf")
        infos = [client.hgetall(contract.worker_key(i.decode())) for i in ids]
        return [contract.WorkerInfo.from_fields(f) for f in infos if f]
    finally:
        client.close()


def _wait_warm(stack, process: subprocess.Popen[bytes], timeout_s: float = 30, pool: str = MODEL) -> None:
    """Until the worker ``process`` heartbeats as warm (in ``pool``)."""
    deadline = time.monotonic() + timeout_s
    while not any(f"-{process.pid}-" in w.worker_id and w.state == contract.WorkerState.WARM
                  for w in _live(stack, pool)):
        assert time.monotonic() < deadline, "the worker never became warm"
        time.sleep(0.1)


async def _timed(client: httpx.AsyncClient, key: str, started: float, **extra) -> tuple[int, float, str]:
    response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra},
                                 headers={"Authorization": f"Bearer {key}"})
    return response.status_code, time.monotonic() - started, response.headers.get("x-flatfare-queue-ms", "")


@pytest.fixture(scope="module")
def sstack(tmp_path_factory):
    # One slow worker (capacity 2, 0.3 s per answer) so queues build up; lease 2 s for quick takeovers.
    env = {"FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "0.3", "FLATFARE_JOB_LEASE_S": "2",
           "FLATFARE_MAX_QUEUE_DEPTH_STANDARD": "400", "FLATFARE_MAX_QUEUE_WAIT_S_STANDARD": "600"}
    with launch_stack(tmp_path_factory.mktemp("sched"), model=MODEL,
                      worker_args=("--engine", "instant", "--max-inflight", "2"), env=env) as stack:
        stack.premium_key = _key(stack, "vip", "premium")
        # The floods below come from one account: let it hold them all (its plan's in-flight cap, 16,
        # would refuse most of them; that cap has tests of its own).
        stack.sql("UPDATE accounts SET max_inflight_override = 1000 WHERE name = 'e2e'")
        yield stack


async def test_premium_flows_under_a_standard_flood_and_standard_still_progresses(sstack) -> None:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=sstack.base_url, timeout=120) as client:
        flood = [asyncio.ensure_future(_timed(client, sstack.api_key, started)) for _ in range(30)]
        await asyncio.sleep(1.0)  # the standard lane is now deep
        vip = [asyncio.ensure_future(_timed(client, sstack.premium_key, started)) for _ in range(10)]
        premium = await asyncio.gather(*vip)
        standard = await asyncio.gather(*flood)
    assert all(status == 200 for status, _, _ in premium + standard)
    last_premium = max(t for _, t, _ in premium)
    standard_done = sorted(t for _, t, _ in standard)
    # Premium, sent a second after 30 standard requests, all finish before most of them ...
    assert sum(t > last_premium for t in standard_done) >= 15
    # ... while standard keeps its guaranteed share: some standard requests finish among them.
    first_premium = min(t for _, t, _ in premium)
    assert any(first_premium <= t <= last_premium for t in standard_done)
    assert all(q.isdigit() for _, _, q in premium)


async def test_a_flooding_account_does_not_hold_up_another_on_its_lane(sstack) -> None:
    """Fair shares: one account queues 16 requests on the standard lane, then a neighbour sends two.
    The lane serves its accounts in turn, so the neighbour's two finish before most of the flood
    (in arrival order, a FIFO, they would finish after all of it)."""
    neighbour = _key(sstack, "neighbour", "pro")
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=sstack.base_url, timeout=120) as client:
        flood = [asyncio.ensure_future(_timed(client, sstack.api_key, started)) for _ in range(16)]
        lane, deadline = _redis(sstack), time.monotonic() + 30
        while int(lane.get(contract.queued_key(MODEL, Lane.STANDARD)) or 0) < 10:
            assert time.monotonic() < deadline, "the flood never queued"
            await asyncio.sleep(0.05)
        lane.close()
        theirs = await asyncio.gather(*(_timed(client, neighbour, started) for _ in range(2)))
        flooded = await asyncio.gather(*flood)
    assert all(status == 200 for status, _, _ in theirs + flooded)
    last_neighbour = max(t for _, t, _ in theirs)
    assert sum(t > last_neighbour for _, t, _ in flooded) >= 8


async def test_requests_past_the_in_flight_caps_are_refused_at_once_and_cost_nothing(sstack) -> None:
    """A key capped at 2 in flight sends 5 at once: 2 run, 3 get 429 key_too_many_inflight through the
    SDK; an account capped at 4 in flight sends 6: 4 run, 2 get too_many_inflight. Only the ones that ran
    were counted and recorded."""
    out = sstack.cli("keys", "create", "--account", "capped", "--plan", "pro", "--max-inflight", "2")
    assert out.returncode == 0, out.stderr
    # A free account's cap (4): the free plan does not offer this model, so a pro account holds it
    # as its own override.
    capped_key, free_key = out.stdout.strip(), _key(sstack, "freebie", "pro")
    sstack.sql("UPDATE accounts SET max_inflight_override = 4 WHERE name = 'freebie'")
    sdk = openai.AsyncOpenAI(base_url=f"{sstack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(key: str) -> str:
        try:
            await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers={"Authorization": f"Bearer {key}"})
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            return exc.code or ""
        return "ok"

    capped = await asyncio.gather(*(one(capped_key) for _ in range(5)))
    free = await asyncio.gather(*(one(free_key) for _ in range(6)))
    await sdk.close()
    assert sorted(capped) == ["key_too_many_inflight"] * 3 + ["ok"] * 2
    assert sorted(free) == ["ok"] * 4 + ["too_many_inflight"] * 2
    day = quota_window("UTC", datetime.now(UTC)).day
    client = _redis(sstack)
    for account, ran in (("capped", 2), ("freebie", 4)):
        account_id = sstack.sql("SELECT id FROM accounts WHERE name = :n", n=account)[0][0]
        assert int(client.get(counter_key(account_id, day)) or 0) == ran
        assert sstack.sql("SELECT count(*) FROM requests WHERE account_id = :a", a=account_id)[0][0] == ran
        # Nothing is left in flight once the answers are in.
        assert client.zcard(contract.inflight_key(account_id)) == 0
    client.close()


async def test_a_full_lane_answers_429_at_once(tmp_path) -> None:
    env = {"FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "5", "FLATFARE_MAX_QUEUE_DEPTH_STANDARD": "3"}
    with launch_stack(tmp_path, model=MODEL, worker_args=("--engine", "instant", "--max-inflight", "1"),
                      env=env) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            started = time.monotonic()
            held = [asyncio.ensure_future(_timed(client, stack.api_key, started)) for _ in range(4)]
            lane = _redis(stack)
            deadline = time.monotonic() + 30
            # One running, three queued: the lane is full.
            while not (int(lane.get(contract.queued_key(MODEL, Lane.STANDARD)) or 0) == 3 and lane.xpending(
                    contract.job_stream(MODEL, Lane.STANDARD), contract.POOL_GROUP)["pending"] == 1):
                assert time.monotonic() < deadline, "the four requests never filled the lane"
                await asyncio.sleep(0.05)
            lane.close()
            t0 = time.monotonic()
            refused = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                                        headers={"Authorization": f"Bearer {stack.api_key}"})
            answered_in = time.monotonic() - t0
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        # At once: not after the 5 s the running job holds the worker (one try, a loaded machine: 2.5 s).
        assert refused.status_code == 429 and answered_in < 2.5
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1


async def test_an_expired_deadline_costs_nothing(sstack) -> None:
    account_id = sstack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
    day = quota_window("UTC", datetime.now(UTC)).day
    client = _redis(sstack)
    before = int(client.get(counter_key(account_id, day)) or 0)
    async with httpx.AsyncClient(base_url=sstack.base_url, timeout=60) as http:
        started = time.monotonic()
        busy = [asyncio.ensure_future(_timed(http, sstack.api_key, started)) for _ in range(12)]
        deadline = time.monotonic() + 30
        while int(client.get(counter_key(account_id, day)) or 0) < before + 12:  # all twelve admitted, ahead
            assert time.monotonic() < deadline, "the busy requests were never admitted"
            await asyncio.sleep(0.05)
        late = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                               headers={"Authorization": f"Bearer {sstack.api_key}", "x-flatfare-max-queue-ms": "200"})
        request_id = late.headers["x-request-id"]
        await asyncio.gather(*busy)
    assert late.status_code == 429 and late.json()["error"]["code"] == "queue_deadline_exceeded"
    row = sstack.sql("SELECT status, billable FROM requests WHERE id = :id", id=request_id)
    assert row == [("failed", False)]
    assert int(client.get(counter_key(account_id, day)) or 0) == before + 12  # the late one gave its unit back
    assert sstack.sql("SELECT count(*) FROM usage_outbox WHERE request_id = :id", id=request_id)[0][0] == 0
    client.close()


def test_bad_deadline_header_is_a_400(sstack) -> None:
    response = httpx.post(f"{sstack.base_url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                          headers={"Authorization": f"Bearer {sstack.api_key}", "x-flatfare-max-queue-ms": "soon"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-flatfare-max-queue-ms"


async def test_kill_9_mid_stream_loses_no_job_and_charges_once(tmp_path) -> None:
    edge = StripeEdge().start()  # records every meter event it is sent
    env = {"FLATFARE_INSTANT_TOKEN_DELAY_S": "0.2", "FLATFARE_JOB_LEASE_S": "2",
           "FLATFARE_STRIPE_API_KEY": "sk_test_kill", "FLATFARE_STRIPE_WEBHOOK_SECRET": "whsec_kill",
           "FLATFARE_STRIPE_API_BASE": edge.url, "FLATFARE_BILLING_OUTBOX_INTERVAL_S": "0.2",
           "FLATFARE_PLANS_CACHE_TTL_S": "0.1"}
    # The seeded plans sell flat (migration 0010): a per-request price makes the e2e account's (pro) metered.
    with launch_stack(tmp_path, model=MODEL, worker_args=("--engine", "instant"), env=env,
                      before_start=("UPDATE plans SET price_per_request_micros = 2000 WHERE name = 'pro'",)) as stack:
        stack.sql("UPDATE accounts SET stripe_customer_id = 'cus_kill' WHERE name = 'e2e'")
        survivor = _worker(stack)
        _wait_warm(stack, survivor)
        client = _redis(stack)
        account_id = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
        try:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http:
                async with http.stream("POST", "/v1/chat/completions",
                                       headers={"Authorization": f"Bearer {stack.api_key}"},
                                       json={"model": MODEL, "messages": MESSAGES, "stream": True}) as response:
                    request_id = response.headers["x-request-id"]
                    lines = response.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    held = client.xpending_range(contract.job_stream(MODEL, Lane.STANDARD), contract.POOL_GROUP,
                                                 "-", "+", 10)
                    holder = held[0]["consumer"].decode()
                    os.kill(int(holder.split("-")[-2]), signal.SIGKILL)
                    rest = [line async for line in lines if line]
            # The survivor took the job over after its lease and failed it cleanly: part of the
            # answer was already out, so running it again would have sent a second, different one.
            assert rest[-1] == "data: [DONE]"
            assert '"worker_lost"' in rest[-2]
            rows = eventually(lambda: stack.sql("SELECT status, billable FROM requests WHERE id = :id", id=request_id),
                              lambda found: len(found) == 1 and found[0][0] != "queued", "the ledger row closed")
            charged = bool(rows[0][1])
            day = quota_window("UTC", datetime.now(UTC)).day
            eventually(lambda: int(client.get(counter_key(account_id, day)) or 0), lambda used: used == int(charged),
                       "its unit kept once if charged, else given back")
            # Charged: one outbox row, sent, and one meter event, which Stripe kept; not charged: none.
            outbox = eventually(lambda: stack.sql("SELECT status FROM usage_outbox WHERE request_id = :id",
                                                  id=request_id),
                                lambda found: found == [] or found[0][0] == "sent", "the outbox row sent")
            answers = [call.answer for call in edge.received if call.identifier == request_id]
            assert (outbox, answers) == (([("sent",)], [Answer.KEPT]) if charged else ([], []))
        finally:
            survivor.kill()
            survivor.wait()
            client.close()
            edge.stop()


async def test_a_job_whose_worker_died_before_its_first_token_is_run_again(sstack) -> None:
    doomed = _worker(sstack, "--max-inflight", "8", FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S="30")
    _wait_warm(sstack, doomed)
    client = _redis(sstack)
    account_id = sstack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
    day = quota_window("UTC", datetime.now(UTC)).day
    try:
        # Read before the requests go out: when the doomed worker holds its first job, the others
        # may not all have been admitted (counted) yet.
        before = int(client.get(counter_key(account_id, day)) or 0)
        async with httpx.AsyncClient(base_url=sstack.base_url, timeout=60) as http:
            started = time.monotonic()
            tasks = [asyncio.ensure_future(_timed(http, sstack.api_key, started)) for _ in range(6)]
            deadline = time.monotonic() + 10
            while True:
                held = client.xpending_range(contract.job_stream(MODEL, Lane.STANDARD), contract.POOL_GROUP,
                                             "-", "+", 50)
                if any(f"-{doomed.pid}-" in h["consumer"].decode() for h in held):
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            doomed.kill()
            results = await asyncio.gather(*tasks)
        assert [status for status, _, _ in results] == [200] * 6  # taken over, run again, answered
        assert int(client.get(counter_key(account_id, day)) or 0) == before + 6  # each counted once
    finally:
        doomed.kill()
        doomed.wait()
        client.close()


async def test_sigterm_drains_cleanly(sstack) -> None:
    draining = _worker(sstack, "--max-inflight", "4", FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S="1.5")
    _wait_warm(sstack, draining)
    client = _redis(sstack)
    try:
        async with httpx.AsyncClient(base_url=sstack.base_url, timeout=60) as http:
            started = time.monotonic()
            tasks = [asyncio.ensure_future(_timed(http, sstack.api_key, started)) for _ in range(6)]
            deadline = time.monotonic() + 10
            while not any(f"-{draining.pid}-" in h["consumer"].decode() for h in client.xpending_range(
                    contract.job_stream(MODEL, Lane.STANDARD), contract.POOL_GROUP, "-", "+", 50)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            draining.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
        assert [status for status, _, _ in results] == [200] * 6
        assert draining.wait(30) == 0
        assert all(f"-{draining.pid}-" not in w.worker_id for w in _live(sstack))
    finally:
        if draining.poll() is None:
            draining.kill()
        client.close()


def test_models_report_warmth(sstack) -> None:
    auth = {"Authorization": f"Bearer {sstack.api_key}"}
    cards = {m["id"]: m for m in httpx.get(f"{sstack.base_url}/v1/models", headers=auth).json()["data"]}
    assert cards[MODEL]["state"] == "warm"
    # The default model is pinned in the catalog but nothing serves it here.
    assert cards["smollm2-135m-instruct"]["state"] == "unavailable"
    starting = _worker(sstack, "--model", "instant-slow-start", FLATFARE_INSTANT_START_DELAY_S="8")
    try:
        deadline = time.monotonic() + 20
        while True:
            cards = {m["id"]: m for m in httpx.get(f"{sstack.base_url}/v1/models", headers=auth).json()["data"]}
            if cards.get("instant-slow-start", {}).get("state") == "starting":
                break
            assert time.monotonic() < deadline, cards
            time.sleep(0.2)
        # Asked while it starts: admitted, and answered once it is warm, saying how long it waited.
        waited = httpx.post(f"{sstack.base_url}/v1/chat/completions", headers=auth, timeout=120,
                            json={"model": "instant-slow-start", "messages": MESSAGES})
        assert waited.status_code == 200, waited.text
        assert int(waited.headers["x-flatfare-model-wait-ms"]) > 0
    finally:
        starting.kill()
        starting.wait()


def test_requests_sharing_a_long_prefix_go_to_the_worker_that_served_it(sstack) -> None:
    other = _worker(sstack, "--max-inflight", "8")
    _wait_warm(sstack, other)
    client = _redis(sstack)
    system = {"role": "system", "content": "You answer questions about this contract. " + "clause " * 200}
    try:
        first = httpx.post(f"{sstack.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {sstack.api_key}"},
                           json={"model": MODEL, "messages": [system, {"role": "user", "content": "q0"}]}, timeout=30)
        assert first.status_code == 200
        owners = [k for k in client.scan_iter(match=contract.prefix_key(MODEL, "*"))]
        assert len(owners) == 1
        owner = client.get(owners[0]).decode()
        own_stream = contract.worker_stream(MODEL, owner)
        before = client.xinfo_stream(own_stream)["entries-added"] if client.exists(own_stream) else 0
        for i in range(1, 5):
            response = httpx.post(f"{sstack.base_url}/v1/chat/completions", timeout=30,
                                  headers={"Authorization": f"Bearer {sstack.api_key}"},
                                  json={"model": MODEL, "messages": [system, {"role": "user", "content": f"q{i}"}]})
            assert response.status_code == 200
        # Routed to the owner's own stream while it had room (the heartbeat refreshes its free slots).
        assert client.xinfo_stream(own_stream)["entries-added"] - before >= 3
        assert client.get(owners[0]).decode() == owner
    finally:
        other.kill()
        other.wait()
        client.close()


def test_an_enterprise_account_uses_its_dedicated_pool(sstack) -> None:
    key = _key(sstack, "acme-corp", "enterprise")
    sstack.sql("UPDATE accounts SET dedicated_pool = 'acme' WHERE name = 'acme-corp'")
    dedicated = _worker(sstack, "--pool", "acme")
    client = _redis(sstack)
    try:
        # Warm in its pool (its first heartbeats say "starting"); the gateway has not looked this pool or
        # this key up before, so no cache of it can be stale.
        _wait_warm(sstack, dedicated, pool=contract.pool_name(MODEL, "acme"))
        response = httpx.post(f"{sstack.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "messages": MESSAGES}, timeout=30)
        assert response.status_code == 200
        drained = client.get(contract.drained_key(contract.pool_name(MODEL, "acme"), Lane.PREMIUM))
        assert int(drained or 0) == 1  # taken from the dedicated pool's premium lane
        # The dedicated pool is not listed to other accounts.
        listed = httpx.get(f"{sstack.base_url}/v1/models", headers={"Authorization": f"Bearer {sstack.api_key}"})
        assert all("@" not in m["id"] for m in listed.json()["data"])
    finally:
        dedicated.kill()
        dedicated.wait()
        client.close()
