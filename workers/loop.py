"""The worker loop: claim jobs (own stream, premium, standard), run them on the engine, reply, acknowledge.

Many jobs run at once (up to the engine's batch capacity) so vLLM's continuous batching has work;
each job's chunks go to its reply stream as the engine yields them. A job is acknowledged only once
its terminal reply is written (or its client is gone); until then its lease is renewed, and jobs of
workers that died are taken over (see :mod:`flatfare.workers.claims`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from flatfare import contract, tracecontext
from flatfare.contract import Endpoint, Job, Lane, Reply, ReplyKind, Usage, WorkerInfo, WorkerState
# A job claimed this soon after it was queued cannot have been cancelled yet (the rule: contract.timing).
from flatfare.contract.timing import FRESH_JOB_MS
from flatfare.logs import bind, log_context, prompts_enabled
from flatfare.workers.claims import Claimed, Claimer
from flatfare.workers.commands import Commands, SleepingEngine
from flatfare.workers.metrics import WorkerMetrics
from flatfare.workers.pace import PaceGovernor
from flatfare.workers.presence import RETRY_S, Presence, listen_for_cancels, now_ms
from flatfare.redis_conn import REDIS_DOWN, stop_if_cancelled, without_read_timeouts
from flatfare.tracecontext import TraceContext
from flatfare.tracing import Spans, Tracer, ms_to_ns
from flatfare.workers.replies import BatchedGet, ReplyWriter

log = logging.getLogger("flatfare.worker")

_DONE = "data: [DONE]"


class EngineLike(SleepingEngine, Protocol):
    max_model_len: int
    max_num_seqs: int

    # ``traceparent``: the worker's span for the job (flatfare.tracecontext), for an engine that traces.
    async def run(self, endpoint: Endpoint, body: dict[str, Any], traceparent: str = "") -> Any: ...

    def unfinished_requests(self) -> int: ...

    def shutdown(self) -> None: ...

    @property
    def errored(self) -> bool: ...


PREFIX_TTL_S = 300
# How long the drain waits for the jobs it cancelled to end before it hands them back regardless.
CANCEL_WAIT_S = 5.0
# How long a claim waits for new work while batch lines are held back for the jobs this worker runs.
HELD_BACK_BLOCK_MS = 50


@dataclass(frozen=True, slots=True)
class _Checks:
    cancelled: bool
    begun: bool


def _error(status: int, message: str, code: str, kind: str = "server_error") -> Reply:
    return Reply(ReplyKind.ERROR, json.dumps(contract.error_body(message, kind, code=code)), status=status,
                 started_ms=now_ms())


def _usage(payload: dict[str, Any]) -> Usage | None:
    usage = payload.get("usage")
    if not usage:
        return None
    # Chat and completions name them prompt/completion tokens; the Responses API input/output tokens.
    return Usage(prompt_tokens=int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0),
                 completion_tokens=int(usage.get("completion_tokens") or usage.get("output_tokens") or 0))


class WorkerLoop:
    def __init__(self, redis: aioredis.Redis, engine: EngineLike, info: WorkerInfo,
                 drain_timeout_s: float = 30.0, metrics: WorkerMetrics | None = None,
                 lease_s: float = contract.DEFAULT_LEASE_S, presence: Presence | None = None,
                 premium_reserve: int = 0, batch_reserve: int | None = None,
                 batch_slots: int | None = None, batch_while_live: int | None = None,
                 governor: PaceGovernor | None = None, tracer: Tracer | None = None) -> None:
        self.redis = redis
        # Flatfare's spans (flatfare.tracing; None: off): each job's, under the gateway's span it carries.
        self.tracer = tracer
        self.spans: dict[str, Spans] = {}
        # Batch lines held at most at once, and while a live job runs (None: no bound beyond the
        # reserve). 1 and 0 on a CPU engine: there a batch line in the engine's batch slows the live
        # jobs' every step (flatfare.workers.settings).
        self.batch_slots = batch_slots
        self.batch_while_live = batch_while_live
        # Slots batch lines may not fill, kept for live traffic: a live request admitted while a batch
        # runs is claimed at once (None: a quarter of the capacity, at least one).
        self.batch_reserve = max(info.capacity // 4, 1) if batch_reserve is None else batch_reserve
        # Slots the standard lane may not fill: under a standard backlog a premium job still finds
        # one free (and vLLM's priority scheduling runs it first), instead of waiting for one to end.
        self.premium_reserve = premium_reserve
        # Holds the engine's pace under a standard backlog by limiting the standard jobs and batch lines
        # running at once (flatfare.workers.pace); None: only the reserve and the capacity bound them.
        self.governor = governor
        self.engine = engine
        self.info = info
        self.drain_timeout_s = drain_timeout_s
        self.lease_ms = int(lease_s * 1000)
        self.pool = info.pool or info.model
        self.claimer = Claimer(redis, self.pool, info.worker_id)
        # Replies, acknowledgements and the cancellation checks share one client whose commands are
        # bounded per pipeline, not per reply (flatfare.redis_conn.without_read_timeouts).
        self._bulk = without_read_timeouts(redis)
        self.replies = ReplyWriter(self._bulk)
        self._lookups = BatchedGet(self._bulk)
        self.presence = presence or Presence(redis, info)
        self.metrics = metrics
        self.inflight: dict[str, asyncio.Task[None]] = {}
        # request id -> (stream, entry id, job) of each job held, for acks, renewals, hand-backs and
        # HELD replies.
        self.entries: dict[str, tuple[str, bytes, Job]] = {}
        # request id -> the worker's span for each job held (its log lines' trace_id and span_id).
        self.traces: dict[str, TraceContext] = {}
        self._handed_back: set[str] = set()
        # Jobs whose entries are being acknowledged as they end: gone from Redis, still in ``entries``.
        self._acking: set[str] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        # Cleared while told to sleep (flatfare.workers.commands): no claims, no takeovers. The claim
        # loop sets _parked once it has stopped claiming, so a pause knows no claim is still landing.
        self._awake = asyncio.Event()
        self._awake.set()
        self._parked = asyncio.Event()
        self.commands = Commands(redis, self, engine)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        await self.claimer.setup()
        self.replies.start()
        self.presence.refresh = self._refresh
        if self.presence._task is None:
            self.presence.start()
        await self.presence.set_state(WorkerState.WARM)
        background = [asyncio.create_task(listen_for_cancels(self.redis, self._cancel), name="cancels"),
                      asyncio.create_task(self._renew_leases(), name="leases"),
                      asyncio.create_task(self._take_over(), name="takeover"),
                      asyncio.create_task(self.commands.follow(), name="commands")]
        if self.governor is not None:
            background.append(asyncio.create_task(self._govern(), name="governor"))
        try:
            await self._claim_loop()
            await self.presence.set_state(WorkerState.DRAINING)
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.replies.stop()
            await self._bulk.aclose()
            await self.presence.stop()

    @property
    def draining(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop taking work; what is held finishes within the drain timeout, the rest is handed back."""
        self._stopping.set()
        self._slot_freed.set()
        self._awake.set()

    async def pause(self) -> None:
        """Stop claiming until :meth:`resume`; what is held finishes within the drain timeout, the rest
        is handed back (another worker of the pool takes it over, or this one once awake)."""
        self._parked.clear()
        self._awake.clear()
        self._slot_freed.set()
        # A claim blocked on the pool's wake stream (up to 1 s) would hold the pause, and with it the
        # engine's sleep and whatever model waits for this slot: ring it, as an admission does.
        with contextlib.suppress(*REDIS_DOWN):
            await self.redis.xadd(self.claimer.wake, {"p": 1}, maxlen=64, approximate=True)
        await self._parked.wait()
        await self._drain()

    def resume(self) -> None:
        self._awake.set()

    def _refresh(self, info: WorkerInfo) -> None:
        info.inflight = len(self.inflight)
        info.extra["engine_unfinished"] = self.engine.unfinished_requests()
        if self.governor is not None:
            info.extra["governor"] = self.governor.state()

    async def _drain(self) -> None:
        if not self.inflight:
            return
        log.info("draining %d jobs (up to %.0f s)", len(self.inflight), self.drain_timeout_s)
        _, pending = await asyncio.wait(list(self.inflight.values()), timeout=self.drain_timeout_s)
        if not pending:
            return
        # Not finished in time: give the jobs back so a live worker takes them over at once.
        held: dict[str, list[bytes]] = {}
        for request_id, task in list(self.inflight.items()):
            if task in pending:
                self._handed_back.add(request_id)
                stream, entry_id, _ = self.entries[request_id]
                held.setdefault(stream, []).append(entry_id)
                task.cancel()
        _, stuck = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        if stuck:  # handed back all the same: the worker must exit
            log.error("%d jobs did not end within %.0f s of their cancellation", len(stuck), CANCEL_WAIT_S)
        await self.claimer.hand_back(held, self.lease_ms)
        log.info("handed back %d jobs", sum(len(ids) for ids in held.values()))

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._awake.is_set():
                self._parked.set()
                await self._awake.wait()
                continue
            if self.engine.errored:
                raise RuntimeError("the engine died; exiting so the supervisor restarts this worker")
            free = self.info.capacity - len(self.inflight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            standard, batch = self._running(Lane.STANDARD), self._running(Lane.BATCH)
            standard_free = min(free, max(self.info.capacity - self.premium_reserve - standard, 0))
            unbounded = batch_free = max(free - self.batch_reserve, 0)
            if self.governor is not None:  # a limit for standard jobs, an allowance for batch lines beside them
                standard_free = min(standard_free, max(self.governor.limit - standard, 0))
                batch_free = min(batch_free, max(self.governor.batch_limit - batch, 0))
            if self.batch_slots is not None:
                batch_free = min(batch_free, max(self.batch_slots - batch, 0))
            if self.batch_while_live is not None and len(self.entries) > batch:  # live jobs run
                batch_free = min(batch_free, max(self.batch_while_live - batch, 0))
            # Work held back while this worker runs jobs (batch lines, or standard jobs past the governed
            # limit): a short wait, so that it resumes soon after one of them ends (nothing wakes the claim
            # then; a premium job's admission does, at once).
            held_back = batch_free < unbounded or standard_free < min(free, max(
                self.info.capacity - self.premium_reserve - standard, 0))
            block_ms = HELD_BACK_BLOCK_MS if held_back and self.entries else 1000
            try:
                claimed = await self.claimer.claim(free, block_ms, standard_free=standard_free, batch_free=batch_free)
            except REDIS_DOWN as exc:
                await self._redis_failed(exc)
                continue
            self._start_all(claimed)

    def _running(self, lane: Lane) -> int:
        return sum(1 for _, _, job in self.entries.values() if job.lane is lane)

    async def _govern(self) -> None:
        """Every window: the engine's pace against the governor's target, and whether work waits: in the
        pool's live lanes (one MGET of their queued counters), or in the engine's own queue all window long."""
        assert self.governor is not None
        keys = [contract.queued_key(self.pool, lane) for lane in contract.LIVE_LANES]
        sample = getattr(self.engine, "pace_sample", None)
        while True:
            await asyncio.sleep(self.governor.window_s)
            engine_waiting = 0
            if sample is not None:  # the engine times its own steps; else the streams' outputs do
                gaps, engine_waiting = sample()
                self.governor.record(gaps)
            try:
                queued = sum(int(v or 0) for v in await self.redis.mget(keys))
            except REDIS_DOWN:
                stop_if_cancelled()
                continue
            self.governor.tick(time.monotonic(), self._running(Lane.STANDARD), queued > 0 or engine_waiting > 0,
                               self._running(Lane.BATCH))

    async def _redis_failed(self, exc: Exception) -> None:
        """Claiming failed: wait for Redis and try again (the engine stays warm). A Redis that lost its
        data lost the consumer groups too: they are made again."""
        log.warning("claiming failed (%s: %s); retrying", exc.__class__.__name__, exc)
        await asyncio.sleep(RETRY_S)
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            with contextlib.suppress(*REDIS_DOWN):
                await self.claimer.setup()

    def _start_all(self, claimed: list[Claimed]) -> None:
        for batch in claimed:  # the lanes' drain counters leave with the next batch of replies
            if batch.lane is not None and not batch.reclaimed and batch.entries:
                self.replies.count(contract.drained_key(self.pool, batch.lane), len(batch.entries))
        for batch in claimed:
            for entry_id, fields in batch.entries:
                self._start(batch, entry_id, fields)

    def _start(self, batch: Claimed, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            job = Job.from_fields(fields)
        except (KeyError, ValueError):
            log.error("dropping malformed job %s", entry_id)
            asyncio.create_task(self.replies.ack(batch.stream, entry_id))
            return
        if job.request_id in self.inflight:  # already running here (a takeover of our own job)
            return
        if self.metrics is not None:
            self.metrics.taken((batch.lane or job.lane).value, job.enqueued_ms)
        self.info.last_used_ms = now_ms()  # its fleet puts the least recently used engine to sleep first
        self.entries[job.request_id] = (batch.stream, entry_id, job)
        # A span of the worker's under the gateway's (a new trace for a job from an older gateway).
        trace = self.traces[job.request_id] = self._trace(batch, job)
        task = asyncio.create_task(self._handle(batch.stream, entry_id, job, batch.reclaimed, trace),
                                   name=job.request_id)
        self.inflight[job.request_id] = task
        task.add_done_callback(lambda _t, rid=job.request_id: self._finished(rid))

    def _trace(self, batch: Claimed, job: Job) -> TraceContext:
        """The job's trace context here. Traced, its spans: the wait in the lane (from the gateway's enqueue
        to this claim, beside the job's span) and the job's, from its claim to its end."""
        if self.tracer is None:
            return tracecontext.continue_or_start(job.traceparent)
        fields = {"flatfare.request_id": job.request_id, "flatfare.lane": (batch.lane or job.lane).value,
                  "flatfare.model": self.info.model, "flatfare.worker_id": self.info.worker_id}
        trace, spans = self.tracer.start("job", job.traceparent, kind="consumer", **fields,
                                         **{"flatfare.reclaimed": batch.reclaimed})
        if spans is None:
            return trace
        self.spans[job.request_id] = spans
        # Beside the job's span, under the gateway's; under the job's for a job that came without a trace
        # (one sampling decision either way: the parent is sampled).
        parent = job.traceparent if tracecontext.parse(job.traceparent) else trace.header()
        _, waited = self.tracer.start("lane wait", parent, start_ns=ms_to_ns(job.enqueued_ms), **fields)
        if waited is not None:
            waited.finish()
        return trace

    def _finished(self, request_id: str) -> None:
        self.info.last_used_ms = now_ms()
        self.inflight.pop(request_id, None)
        self.entries.pop(request_id, None)
        self.traces.pop(request_id, None)
        if self.spans and (spans := self.spans.pop(request_id, None)) is not None:
            spans.finish()
        self._handed_back.discard(request_id)
        self._acking.discard(request_id)
        self._slot_freed.set()
        if not self.inflight:
            self.presence.soon()

    async def _renew_leases(self) -> None:
        orphans = 0
        while True:
            await asyncio.sleep(min(self.lease_ms / 3000, contract.HELD_EVERY_S) if orphans else self.lease_ms / 3000)
            held: dict[str, list[bytes]] = {}
            for stream, entry_id, _ in list(self.entries.values()):
                held.setdefault(stream, []).append(entry_id)
            if not held:
                orphans = 0
                continue
            try:
                lost = await self.claimer.renew(held)
            except REDIS_DOWN:
                stop_if_cancelled()
                continue
            orphans = self._still_holding(lost)

    def _still_holding(self, lost: set[tuple[str, bytes]]) -> int:
        """Jobs whose queue entries Redis lost with its data run on here, but nothing in Redis says
        so any more: tell each one's gateway (a HELD reply), so it does not answer them as lost. A job
        acknowledged (its entry deleted) while the renewal was on its way is ending, not lost."""
        orphans = 0
        for stream, entry_id, job in list(self.entries.values()):
            if (stream, entry_id) in lost and job.request_id not in self._acking:
                self.replies.send(job, Reply(ReplyKind.HELD), first=True)
                orphans += 1
        if orphans:
            log.warning("%d running jobs' queue entries are gone from Redis (it lost its data?): their gateways "
                        "are told they still run", orphans)
        return orphans

    async def _take_over(self) -> None:
        """Run the jobs of workers that died (their lease ran out). A busy worker takes a few of them
        beyond its capacity (the engine queues them): its slots refill with new jobs as they free up,
        so waiting for a free slot would leave the stranded jobs, older than any, waiting for the
        backlog to drain."""
        while True:
            await asyncio.sleep(self.lease_ms / 2000)
            free = max(self.info.capacity - len(self.inflight), max(self.info.capacity // 8, 1))
            if self._stopping.is_set() or not self._awake.is_set():
                continue
            try:
                live = await self.presence.live_workers()
                self._start_all(await self.claimer.take_over(free, self.lease_ms, live))
            except REDIS_DOWN:
                stop_if_cancelled()
                log.warning("takeover pass failed", exc_info=True)

    def _cancel(self, request_id: str) -> None:
        task = self.inflight.get(request_id)
        if task is not None:
            trace = self.traces.get(request_id)
            # Written by the cancel listener, not the job's task: the job's fields are given here.
            with log_context(request_id=request_id, model=self.info.model, **(trace.log_fields() if trace else {})):
                log.info("aborting %s: its client went away", request_id)
            task.cancel()

    # -- one job -----------------------------------------------------------------------------

    async def _handle(self, stream: str, entry_id: bytes, job: Job, reclaimed: bool, trace: TraceContext) -> None:
        bind(request_id=job.request_id, model=self.info.model, **trace.log_fields())  # this task's log lines
        try:
            try:
                checks = await self._checks(job, reclaimed)
            except REDIS_DOWN:
                if reclaimed:  # whether output went out is unknown: leave it for a later takeover
                    log.warning("takeover of %s postponed: Redis is unreachable", job.request_id)
                    self._handed_back.add(job.request_id)
                    return
                checks = _Checks(cancelled=False, begun=False)  # a cancel still arrives by pub/sub
            if checks.cancelled:
                log.info("skipping %s: its client went away while it was queued", job.request_id)
                self._ended_without_reply("skipped")
                return
            if job.deadline_ms and now_ms() > job.deadline_ms:
                await self._reply(job, _error(429, "The request waited in the queue past its "
                                              "x-flatfare-max-queue-ms deadline; it was not run.",
                                              "queue_deadline_exceeded", "rate_limit_error"))
                return
            if checks.begun:
                # Its worker died after part of the answer went out: running it again would send a
                # second, different answer after the first one's start. Fail it cleanly instead.
                await self._reply(job, _error(502, "The worker running this request was lost in the "
                                              "middle of its answer; retry it.", "worker_lost"))
                return
            if job.prefix:
                await self._own_prefix(job.prefix)
            await self._run(job, now_ms(), trace)
        except asyncio.CancelledError:
            # The client went away, or the drain timed out and the job is handed back: the engine
            # request is aborted by closing its generator.
            self._ended_without_reply("handed_back" if job.request_id in self._handed_back else "cancelled")
            raise
        except Exception:  # noqa: BLE001 - any engine failure must still answer the client
            log.exception("job %s failed", job.request_id)
            with contextlib.suppress(Exception):
                await self._reply(job, _error(500, "The worker failed while running this request; retry it.",
                                              "worker_error"))
        finally:
            if job.request_id not in self._handed_back:
                self._acking.add(job.request_id)
                await asyncio.shield(self.replies.ack(stream, entry_id, job.request_id))

    async def _checks(self, job: Job, reclaimed: bool) -> _Checks:
        """Whether the client went away while the job waited and (for a takeover) whether output
        already went out. Jobs claimed together share one round trip for these."""
        if not reclaimed and now_ms() - job.enqueued_ms < FRESH_JOB_MS:
            return _Checks(cancelled=False, begun=False)
        keys = [contract.cancel_key(job.request_id)]
        if reclaimed:
            keys.append(contract.begun_key(job.request_id))
        values = await self._lookups.get(keys)
        return _Checks(cancelled=values[0] is not None, begun=reclaimed and values[1] is not None)

    async def _own_prefix(self, prefix: str) -> None:
        # Claimed before the engine runs, not after the answer: from its prefill on, this worker's
        # prefix cache holds the prompt, and requests arriving meanwhile (or right after the answer
        # reached the client) should be routed here.
        with contextlib.suppress(*REDIS_DOWN):
            await self.redis.set(contract.prefix_key(self.pool, prefix), self.info.worker_id, ex=PREFIX_TTL_S)

    async def _run(self, job: Job, started_ms: int, trace: TraceContext) -> None:
        body = json.loads(job.body)
        if prompts_enabled():  # FLATFARE_LOG_PROMPTS: customers' data, off unless switched on
            log.info("prompt of %s", job.request_id, extra={"prompt": body.get("messages", body.get("prompt"))})
        body["request_id"] = job.request_id
        body["priority"] = job.priority  # premium wins inside the batch (--scheduling-policy priority)
        wants_usage = False
        if body.get("stream"):
            options = body.get("stream_options") or {}
            wants_usage = bool(options.get("include_usage"))
            # Always ask for usage so the ledger gets token counts; drop the chunk if not asked.
            body["stream_options"] = {**options, "include_usage": True}
        # The engine's own spans (vLLM's OTLP export, when switched on) continue the worker's.
        spans = self.spans.get(job.request_id) if self.spans else None
        if spans is not None:  # ends with the job's span (its last reply written)
            spans.begin("engine run")
        result = await self.engine.run(job.endpoint, body, traceparent=trace.header())
        if result.error is not None:
            await self._reply(job, Reply(ReplyKind.ERROR, json.dumps(result.error), status=result.error_status,
                                         started_ms=started_ms))
            return
        if result.body is not None:
            usage = _usage(json.loads(result.body))
            if prompts_enabled():
                log.info("output of %s", job.request_id, extra={"output": result.body})
            await self._reply(job, Reply(ReplyKind.RESPONSE, result.body, usage=usage, started_ms=started_ms,
                                         first_token_ms=now_ms()))
            return
        await self._stream(result.stream, job, wants_usage, started_ms)

    async def _stream(self, stream: Any, job: Job, wants_usage: bool, started_ms: int) -> None:
        usage: Usage | None = None
        first_token_ms = 0
        # The streams' outputs time the pace only for an engine that does not time it itself.
        governor = self.governor if not hasattr(self.engine, "pace_sample") else None
        try:
            async for event in stream:
                if governor is not None:
                    governor.token(job.request_id, time.monotonic())
                for line in event.split("\n\n"):
                    if not line:
                        continue
                    if line.startswith(_DONE):
                        break
                    payload = line.removeprefix("data: ")
                    if '"choices":[]' in payload and '"usage"' in payload:
                        usage = _usage(json.loads(payload))
                        if not wants_usage:
                            continue
                    elif '"type":"response.completed"' in payload:  # a Responses stream's usage is in its end
                        usage = _usage(json.loads(payload)["response"])
                    first = not first_token_ms
                    if first:
                        first_token_ms = now_ms()
                    # The first chunk carries the start time (the gateway's x-flatfare-queue-ms) and
                    # sets the TTL, which the terminal reply refreshes.
                    await self._reply(job, Reply(ReplyKind.CHUNK, payload, started_ms=started_ms if first else 0),
                                      first=first)
        finally:
            if governor is not None:
                governor.end(job.request_id)
            await stream.aclose()
        await self._reply(job, Reply(ReplyKind.END, usage=usage, started_ms=started_ms,
                                     first_token_ms=first_token_ms))

    async def _reply(self, job: Job, reply: Reply, *, first: bool = True) -> None:
        if not reply.kind.terminal:  # chunks go out with the next batch, in order
            self.replies.send(job, reply, first=first)
            return
        await self.replies.send_and_wait(job, reply)
        if self.metrics is not None:
            self.metrics.replied(reply)
        if self.spans and (spans := self.spans.get(job.request_id)) is not None:
            spans.note(**{"http.response.status_code": reply.status})
        if log.isEnabledFor(logging.INFO):
            # One line per job answered, as the gateway writes one per request: where its time went here.
            done_ms = now_ms()
            started = reply.started_ms
            log.info("answered %s: %d", job.request_id, reply.status, extra={
                "lane": job.lane.value, "status": reply.status,
                "queue_ms": started - job.enqueued_ms if started else done_ms - job.enqueued_ms,
                "run_ms": done_ms - started if started else 0})

    def _ended_without_reply(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.ended_without_reply(outcome)
