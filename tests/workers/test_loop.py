"""The worker loop against a real redis-server, with the instant engine (no model) and the contract's
formats: a queued job is claimed, run, answered on its reply stream and then acknowledged and deleted;
a job whose client left, or whose deadline passed, is not run; a takeover never runs a job twice; the
drain stops claiming, finishes what runs, and hands back what it cannot finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from flatfare import contract, tracecontext
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane, Reply, ReplyKind, Usage, WorkerInfo
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue, QuotaClaim
from flatfare.logs import JsonLinesFormatter
from flatfare.redis_conn import connect
from flatfare.workers.claims import Claimer
from flatfare.workers.instant import FILLER, InstantEngine
from flatfare.workers.loop import WorkerLoop
from flatfare.workers.presence import now_ms

POOL = "instant"
GATEWAY_INBOX = contract.gateway_replies("g1")
CHAT = {"model": POOL, "messages": [{"role": "user", "content": "hi"}]}


class Worker:
    """A running :class:`WorkerLoop` on its own Redis client; stopped (and drained) by the fixture."""

    def __init__(self, loop: WorkerLoop, task: asyncio.Task[None]) -> None:
        self.loop = loop
        self.task = task

    async def stop(self, timeout_s: float = 30.0) -> None:
        self.loop.stop()
        await asyncio.wait_for(self.task, timeout_s)


@pytest.fixture
async def start_worker(redis_url: str) -> AsyncIterator[Callable[..., Any]]:
    started: list[Worker] = []
    clients: list[aioredis.Redis] = []

    async def start(engine: InstantEngine | None = None, *, capacity: int = 8, worker_id: str = "w1",
                    drain_timeout_s: float = 30.0, lease_s: float = contract.DEFAULT_LEASE_S,
                    batch_slots: int | None = None, batch_while_live: int | None = None) -> Worker:
        engine = engine or InstantEngine(tokens=4)
        client = connect(redis_url)
        clients.append(client)
        info = WorkerInfo(worker_id=worker_id, model=POOL, max_model_len=engine.max_model_len, capacity=capacity,
                          engine="instant", started_ms=now_ms())
        loop = WorkerLoop(client, engine, info, drain_timeout_s=drain_timeout_s, lease_s=lease_s,
                          batch_slots=batch_slots, batch_while_live=batch_while_live)
        worker = Worker(loop, asyncio.create_task(loop.run()))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if not worker.task.done():
            with contextlib.suppress(Exception):
                await worker.stop()
    for client in clients:
        await client.aclose()


def _job(request_id: str, body: dict[str, Any] | None = None, *, endpoint: Endpoint = Endpoint.CHAT,
         lane: Lane = Lane.STANDARD, reply_to: str = GATEWAY_INBOX, enqueued_ms: int | None = None,
         deadline_ms: int = 0) -> Job:
    return Job(request_id=request_id, endpoint=endpoint, body=json.dumps(body or CHAT),
               enqueued_ms=now_ms() if enqueued_ms is None else enqueued_ms, lane=lane, deadline_ms=deadline_ms,
               reply_to=reply_to)


async def _queue(redis: aioredis.Redis, job: Job, account_id: int = 1) -> None:
    """Put the job where a gateway's admission puts it: its account's queue on its lane."""
    await redis.set(EPOCH_KEY, 1, nx=True)
    queue = LaneQueue(redis, {lane: LaneLimits(1000, 60.0) for lane in Lane})
    window = quota_window("UTC", datetime.now(UTC))
    job = replace(job, account_id=account_id)
    await queue.admit(job, POOL, QuotaClaim(account_id, window.day, None, expiry(window.resets_at),
                                            inflight_expires_ms=now_ms() + 60_000))


async def _replies(redis: aioredis.Redis, request_id: str, stream: str = GATEWAY_INBOX) -> list[Reply]:
    entries = await redis.xrange(stream)
    if stream != GATEWAY_INBOX:
        return [Reply.from_fields(fields) for _, fields in entries]
    return [Reply.from_fields(fields) for _, fields in entries if fields[b"i"] == request_id.encode()]


async def _eventually(predicate: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _answered(redis: aioredis.Redis, request_id: str, stream: str = GATEWAY_INBOX) -> list[Reply]:
    async def terminal() -> list[Reply] | None:
        replies = await _replies(redis, request_id, stream)
        return replies if replies and replies[-1].kind.terminal else None

    return await _eventually(terminal)


async def _settled(redis: aioredis.Redis, lane: Lane = Lane.STANDARD) -> None:
    """Every job of the lane acknowledged and deleted: nothing pending, nothing left in the stream."""
    stream = contract.job_stream(POOL, lane)

    async def empty() -> bool:
        pending = await redis.xpending(stream, contract.POOL_GROUP)
        return pending["pending"] == 0 and await redis.xlen(stream) == 0

    await _eventually(empty)


async def test_a_job_is_claimed_run_answered_acked_and_deleted(redis, start_worker) -> None:
    await start_worker()
    await _queue(redis, _job("r1", {**CHAT, "max_tokens": 3}))
    [reply] = await _answered(redis, "r1")
    # Out of its account's in-flight set before the answer was written: a client that sends its next
    # request on reading this answer finds the slot free.
    assert await redis.zcard(contract.inflight_key(1)) == 0
    assert (reply.kind, reply.status, reply.usage) == (ReplyKind.RESPONSE, 200, Usage(8, 3))
    assert reply.started_ms > 0 and reply.first_token_ms >= reply.started_ms
    body = json.loads(reply.data)
    assert (body["id"], body["object"]) == ("chatcmpl-r1", "chat.completion")
    assert body["choices"][0]["message"]["content"] == FILLER * 3
    await _settled(redis)
    assert 0 < await redis.ttl(GATEWAY_INBOX) <= contract.REPLY_TTL_S  # the inbox outlives no reader
    assert int(await redis.get(contract.drained_key(POOL, Lane.STANDARD))) == 1  # the lane's drain rate
    assert await redis.exists(contract.begun_key("r1")) == 0


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_stream_is_answered_chunk_by_chunk_then_ended(redis, start_worker, include_usage: bool) -> None:
    await start_worker(InstantEngine(tokens=5))
    body = {"model": POOL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": include_usage}}
    # A request's own reply stream (an idempotent request's): entries carry no request id.
    await _queue(redis, _job("r2", body, endpoint=Endpoint.COMPLETION, lane=Lane.PREMIUM, reply_to=""))
    replies = await _answered(redis, "r2", contract.reply_stream("r2"))
    chunks, end = replies[:-1], replies[-1]
    assert [r.kind for r in chunks] == [ReplyKind.CHUNK] * (6 if include_usage else 5)
    assert [json.loads(c.data)["choices"][0]["text"] for c in chunks[:5]] == [FILLER] * 5
    assert chunks[0].started_ms > 0 and all(c.started_ms == 0 for c in chunks[1:])  # on the first only
    if include_usage:  # asked for: passed on; otherwise asked of the engine anyway, for the ledger
        assert json.loads(chunks[-1].data)["usage"]["completion_tokens"] == 5
    assert (end.kind, end.usage) == (ReplyKind.END, Usage(8, 5))
    assert end.first_token_ms >= end.started_ms > 0
    raw = await redis.xrange(contract.reply_stream("r2"))
    assert all(b"i" not in fields for _, fields in raw)
    await _settled(redis, Lane.PREMIUM)
    assert await redis.exists(contract.begun_key("r2")) == 0  # deleted with the ack


async def test_a_job_whose_client_left_while_it_was_queued_is_skipped(redis, start_worker) -> None:
    # Queued a second ago (so the worker checks), and its gateway set the cancel key since.
    await redis.set(contract.cancel_key("gone"), 1)
    await _queue(redis, _job("gone", enqueued_ms=now_ms() - 1000))
    await _queue(redis, _job("after", enqueued_ms=now_ms() - 1000))
    await start_worker()
    await _answered(redis, "after")
    await _settled(redis)
    assert await _replies(redis, "gone") == []  # acknowledged without an answer: nobody is listening


async def test_a_running_job_is_aborted_when_its_client_leaves(redis, start_worker) -> None:
    engine = InstantEngine(tokens=1000, token_delay_s=0.01)
    await start_worker(engine)
    await _queue(redis, _job("slow", {**CHAT, "stream": True}))
    await _eventually(lambda: _replies(redis, "slow"))  # it has started

    async def aborted() -> bool:  # the gateway publishes until the worker hears it
        await redis.publish(contract.CANCEL_CHANNEL, "slow")
        return engine.unfinished_requests() == 0

    await _eventually(aborted)
    await _settled(redis)
    replies = await _replies(redis, "slow")
    assert len(replies) < 1000 and not any(r.kind.terminal for r in replies)


async def test_a_job_past_its_deadline_is_refused_without_running(redis, start_worker) -> None:
    await _queue(redis, _job("late", {**CHAT, "stream": True}, deadline_ms=now_ms() - 1))
    await start_worker()
    [reply] = await _answered(redis, "late")  # no chunk: the engine never ran it
    assert (reply.kind, reply.status) == (ReplyKind.ERROR, 429)
    assert json.loads(reply.data)["error"]["code"] == "queue_deadline_exceeded"
    await _settled(redis)


async def test_a_job_taken_over_after_its_output_began_fails_instead_of_running_again(redis, start_worker) -> None:
    """A worker died after the first chunk went out: the job's lease runs out, a live worker takes it
    over, sees the begun marker and answers 502 rather than a second, different answer."""
    dead = Claimer(redis, POOL, "w-dead")
    await dead.setup()
    for request_id in ("begun", "not-begun"):
        await _queue(redis, _job(request_id, enqueued_ms=now_ms() - 1000))
    assert sum(len(c.entries) for c in await dead.claim(2, block_ms=10)) == 2  # then it died
    await redis.set(contract.begun_key("begun"), 1)
    await start_worker(lease_s=0.5)
    [lost] = await _answered(redis, "begun")
    assert (lost.kind, lost.status, json.loads(lost.data)["error"]["code"]) == (ReplyKind.ERROR, 502, "worker_lost")
    [rerun] = await _answered(redis, "not-begun")  # nothing went out: it runs again
    assert (rerun.kind, rerun.status) == (ReplyKind.RESPONSE, 200)
    await _settled(redis)


async def test_the_drain_stops_claiming_and_finishes_running_jobs(redis, start_worker) -> None:
    engine = InstantEngine(tokens=20, token_delay_s=0.02)
    worker = await start_worker(engine, capacity=2)
    for request_id in ("a", "b", "waiting"):
        await _queue(redis, _job(request_id, {**CHAT, "stream": True}))
    await _eventually(lambda: _replies(redis, "b"))
    assert set(worker.loop.inflight) == {"a", "b"}  # the third waits for a free slot

    await worker.stop()
    for request_id in ("a", "b"):
        replies = await _replies(redis, request_id)
        assert [r.kind for r in replies] == [ReplyKind.CHUNK] * 20 + [ReplyKind.END]
    stream = contract.job_stream(POOL, Lane.STANDARD)
    # The third was never claimed: still queued, delivered to nobody, for another worker to take.
    assert await redis.get(contract.queued_key(POOL, Lane.STANDARD)) == b"1"
    assert (await redis.xpending(stream, contract.POOL_GROUP))["pending"] == 0
    assert await _replies(redis, "waiting") == []
    assert await redis.zscore(contract.pool_key(POOL), "w1") is None  # it left the pool


async def test_a_job_that_outlasts_the_drain_is_handed_back(redis, start_worker) -> None:
    engine = InstantEngine(tokens=10_000, token_delay_s=0.01)
    worker = await start_worker(engine, drain_timeout_s=0.3)
    await _queue(redis, _job("long", {**CHAT, "stream": True}))
    await _eventually(lambda: _replies(redis, "long"))
    stream = contract.job_stream(POOL, Lane.STANDARD)
    [held] = await redis.xpending_range(stream, contract.POOL_GROUP, "-", "+", 10)
    entry_id = held["message_id"]
    await worker.stop()
    assert not any(r.kind.terminal for r in await _replies(redis, "long"))
    assert engine.unfinished_requests() == 0  # the engine request was aborted
    # Still pending, and idle enough for a live worker's takeover pass to take at once.
    taken = await Claimer(redis, POOL, "w2").take_over(10, int(contract.DEFAULT_LEASE_S * 1000), set())
    assert [(c.stream, [e[0] for e in c.entries], c.reclaimed) for c in taken] == [(stream, [entry_id], True)]


async def test_the_worker_stops_when_redis_py_turns_a_cancellation_into_a_connection_error(
        redis, start_worker, monkeypatch) -> None:
    """redis-py can surface a cancellation in the middle of a command as a ConnectionError; the worker's
    retrying loops (heartbeat, commands, leases, takeover, cancellations) must still stop (CI once
    saw a worker whose heartbeat outlived stop() by 30 s)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from flatfare.workers.presence import Presence

    real_beat = Presence.beat_now

    async def beat_swallowing_cancels(self: Presence) -> None:
        try:
            await real_beat(self)
            await asyncio.sleep(0.05)  # a slow command: where the cancellation lands
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None

    monkeypatch.setattr(Presence, "beat_now", beat_swallowing_cancels)
    worker = await start_worker()
    await asyncio.sleep(1.5)
    await worker.stop(timeout_s=15)


@pytest.mark.parametrize("batch_while_live", [0, None])
async def test_batch_lines_wait_while_a_live_job_runs_on_a_cpu_worker(redis, start_worker, batch_while_live) -> None:
    """On the CPU every sequence in the engine's batch slows the others, so a CPU worker (batch_while_live
    0) takes no batch line while a live job runs, and takes them once it ended. Without the bound
    (None: an accelerator's worker) the same lines run beside the live job: the check can fail."""
    worker = await start_worker(InstantEngine(tokens=2, first_token_delay_s=1.0), batch_while_live=batch_while_live)
    await _queue(redis, _job("live"))
    await _eventually(lambda: _async(lambda: "live" in worker.loop.entries))
    for line in range(3):
        job = _job(f"batch_x-{line}", lane=Lane.BATCH, reply_to=contract.BATCH_REPLIES)
        await redis.xadd(contract.job_stream(POOL, Lane.BATCH), job.to_fields())
    await redis.xadd(contract.wake_stream(POOL), {"j": 1})  # as the batch dispatcher feeds a pool
    lanes_beside_live: set[Lane] = set()
    deadline = time.monotonic() + 30
    while "live" in worker.loop.entries:
        lanes_beside_live |= {job.lane for _, _, job in worker.loop.entries.values()}
        assert time.monotonic() < deadline, "the live job did not end within 30 s"
        await asyncio.sleep(0.01)
    if batch_while_live == 0:
        assert Lane.BATCH not in lanes_beside_live
    else:
        assert Lane.BATCH in lanes_beside_live
    # Then the lines run.
    await _eventually(lambda: _batch_answered(redis, 3))


async def _async(value: Callable[[], Any]) -> Any:
    return value()


async def _batch_answered(redis: aioredis.Redis, lines: int) -> bool:
    """Whether ``lines`` batch lines have their final reply (one shared stream, named by request id)."""
    entries = await redis.xrange(contract.BATCH_REPLIES)
    done = {fields[b"i"] for _, fields in entries if Reply.from_fields(fields).kind.terminal}
    return len(done) >= lines


async def test_a_cpu_worker_runs_one_batch_line_at_a_time(redis, start_worker) -> None:
    """batch_slots bounds the batch lines held at once (1 on the CPU); each next line is taken soon after
    the last ends, without waiting for a new admission to wake the claim."""
    worker = await start_worker(InstantEngine(tokens=2, first_token_delay_s=0.2), batch_slots=1)
    for line in range(4):
        job = _job(f"batch_x-{line}", lane=Lane.BATCH, reply_to=contract.BATCH_REPLIES)
        await redis.xadd(contract.job_stream(POOL, Lane.BATCH), job.to_fields())
    await redis.xadd(contract.wake_stream(POOL), {"j": 1})
    most, deadline = 0, time.monotonic() + 30
    while not await _batch_answered(redis, 4):
        most = max(most, sum(1 for _, _, job in worker.loop.entries.values() if job.lane is Lane.BATCH))
        assert time.monotonic() < deadline, "the batch lines were not answered within 30 s"
        await asyncio.sleep(0.01)
    assert most == 1



async def test_a_worker_beats_as_soon_as_its_last_job_ends(redis, start_worker, monkeypatch) -> None:
    """Its fleet waits to see it idle before it may put its engine to sleep for another model: the
    beat after its last job goes at once, not at the next heartbeat (here an hour away)."""
    monkeypatch.setattr(contract, "HEARTBEAT_INTERVAL_S", 3600.0)
    await start_worker()

    async def beat() -> WorkerInfo | None:
        fields = await redis.hgetall(contract.worker_key("w1"))
        return WorkerInfo.from_fields(fields) if fields else None

    await _eventually(beat)
    before = now_ms()
    await _queue(redis, _job("r1", {**CHAT, "max_tokens": 3}))
    await _answered(redis, "r1")

    async def idle_seen() -> bool:
        info = await beat()
        return info is not None and info.inflight == 0 and info.last_used_ms >= before

    await _eventually(idle_seen)


class TracedEngine(InstantEngine):
    """The instant engine, keeping the trace context each request was handed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.traceparents: dict[str, str] = {}

    async def run(self, endpoint: Endpoint, body: dict[str, Any], traceparent: str = "") -> Any:
        self.traceparents[body["request_id"]] = traceparent
        return await super().run(endpoint, body, traceparent)


async def test_a_job_runs_under_a_span_of_the_workers_in_its_requests_trace(redis, start_worker) -> None:
    """The job's traceparent (the gateway's span) is continued: the engine gets a span of the worker's in
    the same trace, and every line the worker writes of the job carries it, the cancel listener's too."""
    records: list[dict[str, Any]] = []

    class Lines(logging.Handler):  # the process's real formatter, its context fields included
        def emit(self, record: logging.LogRecord) -> None:
            records.append(json.loads(JsonLinesFormatter().format(record)))

    handler = Lines(logging.INFO)
    logger = logging.getLogger("flatfare.worker")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        engine = TracedEngine(tokens=1000, token_delay_s=0.01)
        await start_worker(engine)
        gateway = tracecontext.continue_or_start("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        await _queue(redis, replace(_job("traced", {**CHAT, "max_tokens": 2}), traceparent=gateway.header()))
        await _queue(redis, replace(_job("traced-slow", {**CHAT, "stream": True}), traceparent=gateway.header()))
        await _queue(redis, _job("untraced", {**CHAT, "max_tokens": 2}))  # from a gateway that sends none
        await _answered(redis, "traced")
        await _answered(redis, "untraced")
        await _eventually(lambda: _replies(redis, "traced-slow"))

        async def aborted() -> bool:
            await redis.publish(contract.CANCEL_CHANNEL, "traced-slow")
            return engine.unfinished_requests() == 0

        await _eventually(aborted)
        await _settled(redis)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    spans = {}
    for request_id in ("traced", "traced-slow"):
        trace_id, span_id, flags = tracecontext.parse(engine.traceparents[request_id])
        assert (trace_id, flags) == (gateway.trace_id, "01") and span_id != gateway.span_id
        spans[request_id] = span_id
        mine = [r for r in records if r.get("request_id") == request_id]
        assert mine and all((r["trace_id"], r["span_id"]) == (trace_id, span_id) for r in mine), mine
    assert spans["traced"] != spans["traced-slow"]
    assert any(r["message"] == "answered traced: 200" for r in records)
    assert any(r["message"] == "aborting traced-slow: its client went away" and r["request_id"] == "traced-slow"
               for r in records)
    untraced = tracecontext.parse(engine.traceparents["untraced"])  # a trace of its own
    assert untraced is not None and untraced[0] != gateway.trace_id
    assert {r["trace_id"] for r in records if r.get("request_id") == "untraced"} == {untraced[0]}


async def test_a_job_acknowledged_while_its_lease_renewal_was_on_its_way_is_not_reported_lost(redis_url) -> None:
    """The renewal finds the entry of a job that is ending gone (the job's acknowledgement deleted it
    between the renewal's snapshot and its XCLAIM): that job is not one whose entry Redis lost, so its
    gateway gets no HELD reply and the log no warning. One still running whose entry is gone does."""
    client = connect(redis_url)
    try:
        engine = InstantEngine(tokens=4)
        info = WorkerInfo(worker_id="w1", model=POOL, max_model_len=engine.max_model_len, capacity=8,
                          engine="instant", started_ms=now_ms())
        loop = WorkerLoop(client, engine, info)
        stream = contract.job_stream(POOL, Lane.STANDARD)
        loop.entries = {"ending": (stream, b"1-0", _job("ending")), "running": (stream, b"2-0", _job("running"))}
        loop._acking.add("ending")
        assert loop._still_holding({(stream, b"1-0")}) == 0
        assert loop._still_holding({(stream, b"1-0"), (stream, b"2-0")}) == 1
    finally:
        await client.aclose()
