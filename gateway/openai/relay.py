"""An admitted request's answer: its worker's replies relayed to the client as they come.

The relay waits for the job's **first** reply before it answers, so an engine-side refusal still
reaches the client as a proper 4xx, not as a 200 stream that fails; then it answers with a whole body
or relays the stream chunk by chunk. Past the client's queue deadline (``x-flatfare-max-queue-ms``),
or a cold model's start bound, a job no worker has taken yet is withdrawn, free. A kind with a
``turn`` (the Responses API) shapes the whole body and each event; every other kind's answer is the
worker's bytes as they are. How the request is then settled is :mod:`.settlement`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from redis.exceptions import RedisError

from flatfare.contract import Reply, ReplyKind
# A request still waiting for its first reply after this long starts watching for its client leaving.
from flatfare.contract.timing import WATCH_AFTER_S
from flatfare.gateway.errors import APIError, error_body
from flatfare.gateway.metrics import GatewayMetrics
from flatfare.gateway.openai.kinds import Turn
from flatfare.gateway.openai.settlement import Accepted, Settlement, now_ms, outcome
from flatfare.gateway.jobpath.pools import Pools
from flatfare.gateway.jobpath.queueing import LaneQueue, Queued
from flatfare.gateway.jobpath.replies import Inbox, ReplyRouter, timed_out
from flatfare.logs import bind
from flatfare.storage.models import RequestStatus
from flatfare.tracing import Spans

_JSON = "application/json"
_SSE = "text/event-stream"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499


class Call:
    """What the service needs of the HTTP request besides its body: a few headers, labels for the
    metrics and log line, and whether the client is still there."""

    __slots__ = ("headers", "labels", "ratelimit", "gone", "_on_leave", "_watch", "watcher", "traceparent", "client",
                 "spans")

    def __init__(self, headers: dict[str, str], watch: Callable[[Call], Awaitable[None]] | None = None,
                 client: str | None = None) -> None:
        self.headers = headers
        # The client's address, as the HTTP server gives it (a trusted proxy's X-Forwarded-For; see
        # FLATFARE_FORWARDED_ALLOW_IPS): what shared-key detection counts. None: not known.
        self.client = client
        # Waits for the client to disconnect, then calls left(); started only when a wait gets long.
        self._watch = watch
        self.watcher: asyncio.Future[None] | None = None
        # plan, model, lane: values the platform checked (bounded label sets), for metrics and logs.
        self.labels: dict[str, str] = {}
        # The rate-limit headers computed when the request was counted.
        self.ratelimit: dict[str, str] | None = None
        self.gone = False
        self._on_leave: Callable[[], None] | None = None
        # The gateway span's W3C traceparent, sent back on the answer (flatfare/tracecontext.py).
        self.traceparent = ""
        # The request's spans (flatfare.tracing), when tracing is on and this request is sampled.
        self.spans: Spans | None = None

    def label(self, **values: str) -> None:
        self.labels.update(values)
        if "model" in values:
            bind(model=values["model"])

    def watch(self, on_leave: Callable[[], None]) -> None:
        """Call ``on_leave`` when the client disconnects (at once if it already has)."""
        self._on_leave = on_leave
        if self.gone:
            on_leave()

    def watch_client(self) -> None:
        """Start noticing a disconnect. Not done for every request: a task per request costs more
        than most answers of a fast model take (see WATCH_AFTER_S)."""
        if self.watcher is None and self._watch is not None:
            self.watcher = asyncio.ensure_future(self._watch(self))

    def left(self) -> None:
        self.gone = True
        if self._on_leave is not None:
            self._on_leave()


@dataclass(slots=True)
class Answer:
    """What goes back to the client: a whole body, or a stream of SSE bytes; then ``after`` runs
    (the ledger close of a whole answer, once it is sent)."""

    status: int
    headers: dict[str, str]
    media_type: str = _JSON
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    after: Callable[[], Awaitable[None]] | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Waiting:
    """What may end a request before any reply: its queue entry (None: nothing to withdraw any more),
    the client's queue deadline and a cold model's start bound (wall-clock ms; 0: none)."""

    queued: Queued | None = None
    deadline_ms: int = 0
    cold_until_ms: int = 0


class Relay:
    def __init__(self, router: ReplyRouter, queue: LaneQueue, pools: Pools, settlement: Settlement,
                 metrics: GatewayMetrics, cold_start_ms: int) -> None:
        self._router = router
        self._queue = queue
        self._pools = pools
        self._settlement = settlement
        self._metrics = metrics
        self.cold_start_ms = cold_start_ms

    async def answer(self, accepted: Accepted, inbox: Inbox, call: Call, turn: Turn | None = None, *,
                     opening: asyncio.Future[None] | None = None, waiting: Waiting = Waiting()) -> Answer:
        headers = {"x-request-id": accepted.request_id}
        call.watch(inbox.leave)
        handed_over = False
        try:
            batch = await self._first_replies(accepted, inbox, call, waiting)
            if opening is not None:
                await self._settlement.recorded(accepted, opening)
            if batch is None:
                await self._settlement.abandon(accepted, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed",
                                               charged=False)
                return Answer(CLIENT_CLOSED, headers)
            first = batch[0]
            if first.started_ms:
                headers["x-flatfare-queue-ms"] = str(max(first.started_ms - accepted.created_ms, 0))
            if waiting.cold_until_ms:  # admitted with no warm worker: how long the model took to take it
                taken_ms = first.started_ms or now_ms()
                headers["x-flatfare-model-wait-ms"] = str(max(taken_ms - accepted.created_ms, 0))
                if first.started_ms:
                    self._metrics.cold_start(accepted.model, accepted.plan, (taken_ms - accepted.created_ms) / 1000)
            if accepted.owner and (first.kind is ReplyKind.CHUNK
                                   or (first.kind is ReplyKind.RESPONSE and first.status < 400)):
                self._metrics.first_token(accepted.model, accepted.lane, accepted.plan,
                                          (now_ms() - accepted.created_ms) / 1000)
            if first.kind.terminal:
                return await self._whole(accepted, first, headers, turn)
            handed_over = True
            call.watch_client()
            return Answer(200, {**headers, **_SSE_HEADERS}, _SSE, stream=self._sse(accepted, inbox, batch, turn))
        finally:
            if not handed_over:
                self._router.close(inbox)

    async def _first_replies(self, accepted: Accepted, inbox: Inbox, call: Call,
                             waiting: Waiting) -> list[Reply] | None:
        """The first replies, or None if the client left first (the caller cancels the job).

        Past the client's queue deadline, a job no worker has taken yet is withdrawn: 429, free. So is
        a cold request's past the cold start's bound: 503, free, saying why no engine came up."""
        timeout_at = accepted.created_ms + int(self._router.timeout_s * 1000)
        queued, deadline_ms = waiting.queued, waiting.deadline_ms
        withdraw_at = min(at for at in (deadline_ms, waiting.cold_until_ms) if at) if queued is not None else 0
        watching = False
        while True:
            wake_at = min(timeout_at, withdraw_at) if queued is not None else timeout_at
            wait_s = max(wake_at - now_ms(), 0) / 1000
            batch = await inbox.next(wait_s if watching else min(wait_s, WATCH_AFTER_S))
            if batch:
                return batch
            if call.gone:
                return None
            if not watching:
                watching = True
                call.watch_client()
                continue
            if queued is not None and now_ms() >= withdraw_at:
                if await self._queue.withdraw(queued):
                    if deadline_ms and now_ms() >= deadline_ms:
                        refused = APIError(429, "The request waited in the queue past its x-flatfare-max-queue-ms "
                                           "deadline; it was not run and costs nothing.",
                                           code="queue_deadline_exceeded", headers={"Retry-After": "1"})
                    else:
                        refused = await self._cold_start_failed(accepted, queued.pool)
                    refused.headers["x-request-id"] = accepted.request_id
                    await self._settlement.abandon(accepted, RequestStatus.FAILED, refused.status,
                                                   refused.code or "", charged=False)
                    raise refused
                queued = None  # a worker has it: no deadline any more
                continue
            if now_ms() >= timeout_at:
                exc = timed_out()
                await self._settlement.abandon(accepted, RequestStatus.FAILED, exc.status, exc.code or "timeout",
                                               charged=False)
                raise exc

    async def _cold_start_failed(self, accepted: Accepted, pool: str) -> APIError:
        try:
            reason = await self._pools.cold_start_reason(accepted.model, pool)
        except RedisError:  # the job is withdrawn already: the answer goes without the fleet's word
            reason = None
        return APIError(503, f"The model '{accepted.model}' did not come up within {self.cold_start_ms / 1000:g} s"
                        f" ({reason or 'no engine of it became ready, and no fleet supervisor said why'}); "
                        "the request was not run and costs nothing. Retry later.", param="model",
                        code="model_cold_start_timeout", headers={"Retry-After": "30"})

    async def _whole(self, accepted: Accepted, reply: Reply, headers: dict[str, str], turn: Turn | None) -> Answer:
        result = outcome(reply, accepted.created_ms, now_ms())

        async def finish() -> None:
            await self._settlement.settle(accepted, result)

        if reply.kind is ReplyKind.END:  # a stream that ended at once still owes the client its end
            body = _DONE if turn is None else await turn.event(accepted.request_id, reply)
            return Answer(reply.status, headers, _SSE, body, after=finish)
        body = reply.data.encode()
        if turn is not None and reply.kind is ReplyKind.RESPONSE and reply.status == 200:
            body = orjson.dumps(await turn.whole(accepted.request_id, orjson.loads(body)))
        return Answer(reply.status, headers, _JSON, body, after=finish)

    async def _sse(self, accepted: Accepted, inbox: Inbox, first: list[Reply],
                   turn: Turn | None) -> AsyncIterator[bytes]:
        last = first[0]
        timed_out_ = False
        timeout_at = accepted.created_ms + int(self._router.timeout_s * 1000)
        try:
            batch = first
            while True:
                events = []
                for reply in batch:
                    last = reply
                    events.append(_event(reply) if turn is None else await turn.event(accepted.request_id, reply))
                yield b"".join(events)  # what arrived together leaves in one write
                if last.kind.terminal or inbox.gone:
                    break
                batch = await inbox.next(max(timeout_at - now_ms(), 0) / 1000)
                if not batch and not inbox.gone:  # no terminal reply before the deadline
                    timed_out_ = True
                    exc = timed_out()
                    error = Reply(ReplyKind.ERROR, orjson.dumps(error_body(exc.status, exc.message, code=exc.code))
                                  .decode(), status=exc.status)
                    yield _event(error) if turn is None else await turn.event(accepted.request_id, error)
                    break
        finally:
            self._router.close(inbox)
            # Runs when the client leaves too: shield the bookkeeping. Output was already produced
            # here, so the request is charged whatever happens next.
            await asyncio.shield(self._end_stream(accepted, last, timed_out_))

    async def _end_stream(self, accepted: Accepted, last: Reply, timed_out_: bool) -> None:
        if timed_out_:
            await self._settlement.abandon(accepted, RequestStatus.FAILED, 504, "timeout", charged=True)
        elif last.kind.terminal:
            # Chunks went out before this terminal reply: output was produced, so it is charged.
            await self._settlement.settle(accepted, outcome(last, accepted.created_ms, now_ms(), produced=True))
        else:
            await self._settlement.abandon(accepted, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed",
                                           charged=True)


def _event(reply: Reply) -> bytes:
    """One reply of a chat or completion stream as the client's SSE bytes."""
    if reply.kind is ReplyKind.CHUNK:
        return b"data: " + reply.data.encode() + b"\n\n"
    if reply.kind is ReplyKind.ERROR:  # the worker failed mid-stream
        return b"data: " + reply.data.encode() + b"\n\n" + _DONE
    return _DONE
