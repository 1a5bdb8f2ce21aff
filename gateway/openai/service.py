"""One completion request through the platform: validate, route, count and queue, record, answer.

Everything a client can get wrong is refused here, before the ledger or the queue see the request.
The service knows nothing of HTTP: :mod:`flatfare.gateway.openai.asgi` hands it the body, the caller and a
:class:`Call` (the few headers it reads, the client's presence) and sends the :class:`Answer` back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import orjson
from redis.exceptions import RedisError

from flatfare.billing.ledger import Charge, DuplicateIdempotencyKey, Ledger, Outcome
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import DailyQuota, QuotaUnavailable, expiry
from flatfare import contract
from flatfare.contract import Endpoint, Job, Reply, ReplyKind
from flatfare.logs import bind
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import RequestRecord, RequestStatus
from flatfare.gateway.prefix_routing import PrefixRouter, prefix_hash
from flatfare.gateway.auth import Caller
from flatfare.gateway.errors import APIError, error_body
from flatfare.billing.held import LOST_CODE, HeldUnits
from flatfare.gateway.metrics import GatewayMetrics
from flatfare.gateway.plans import PlanBook
from flatfare.gateway.pools import Pools
from flatfare.gateway.openai.capabilities import check_capabilities
from flatfare.gateway.openai.checks import (IDEMPOTENCY_WINDOW_S, check_caps, check_key_allows, deadline_ms_of,
                                            expired, idempotency_key_of)
from flatfare.gateway.openai.kinds import KINDS, parse_body
from flatfare.gateway.queueing import KeyQuotaSpent, LaneQueue, QuotaClaim, QuotaSpent, Queued, TooManyInFlight
from flatfare.gateway.quota_headers import ratelimit_headers
from flatfare.gateway.replies import JOB_LOST, Inbox, Replies, ReplyRouter, timed_out
from flatfare.gateway.openai.refusals import key_ratelimit, refusal
from flatfare.gateway.openai.screen import RequestScreen
from flatfare.gateway.openai.prompt_length import TokenCounter

log = logging.getLogger("flatfare.gateway")

# Fields only the platform sets: the engine's request id and scheduling priority.
_RESERVED_FIELDS = ("request_id", "priority")
_JSON = "application/json"
_SSE = "text/event-stream"
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499
# A request still waiting for its first reply after this long starts watching for its client leaving.
WATCH_AFTER_S = 0.05
# How long an answer's end waits for its ledger row to close before leaving that to the background.
CLOSE_WAIT_S = 2.0
# An in-flight entry outlives its request's timeout by this much before it stops counting.
INFLIGHT_SLACK_S = 60.0


def new_request_id() -> str:
    return uuid.uuid4().hex


def _billable(reply: Reply) -> bool:
    """A request is charged once the engine produced output; earlier failures give the unit back."""
    return reply.first_token_ms > 0 or (reply.kind is not ReplyKind.ERROR and reply.status < 400)


def _outcome(reply: Reply, created_ms: int, finished_ms: int, produced: bool = False) -> Outcome:
    usage = reply.usage
    failed = reply.kind is ReplyKind.ERROR
    error_code = None
    if failed:
        error_code = (orjson.loads(reply.data).get("error") or {}).get("code") or f"http_{reply.status}"
    return Outcome(
        status=RequestStatus.FAILED if failed else RequestStatus.SUCCEEDED,
        http_status=reply.status,
        queue_ms=max(reply.started_ms - created_ms, 0) if reply.started_ms else None,
        ttft_ms=max(reply.first_token_ms - created_ms, 0) if reply.first_token_ms else None,
        duration_ms=finished_ms - created_ms,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        error_code=str(error_code) if error_code else None,
        billable=produced or _billable(reply),
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class Call:
    """What the service needs of the HTTP request besides its body: a few headers, labels for the
    metrics and log line, and whether the client is still there."""

    __slots__ = ("headers", "labels", "ratelimit", "gone", "_on_leave", "_watch", "watcher")

    def __init__(self, headers: dict[str, str], watch: Callable[[Call], Awaitable[None]] | None = None) -> None:
        self.headers = headers
        # Waits for the client to disconnect, then calls left(); started only when a wait gets long.
        self._watch = watch
        self.watcher: asyncio.Future[None] | None = None
        # plan, model, lane: values the platform checked (bounded label sets), for metrics and logs.
        self.labels: dict[str, str] = {}
        # The rate-limit headers computed when the request was counted.
        self.ratelimit: dict[str, str] | None = None
        self.gone = False
        self._on_leave: Callable[[], None] | None = None

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
class Admission:
    """A request the platform took on: what to undo or settle when it ends."""

    request_id: str
    created_ms: int
    account_id: int
    quota_day: str
    # False for a replay of an idempotent request: it neither owns the job nor pays again.
    owner: bool = True
    # For the metrics: the routed model and the plan's lane.
    model: str = ""
    lane: str = ""
    # The idempotent request's own reply stream is kept for replays.
    keep_reply: bool = False
    # The quota counters' generation its unit was counted in (see flatfare.billing.quota's give-back).
    generation: str = ""
    # The API key whose counter the unit counted too (None: a replay, which counted nothing).
    key_id: int | None = None


class CompletionService:
    def __init__(self, pools: Pools, router: ReplyRouter, replies: Replies, ledger: Ledger, plans: PlanBook,
                 quota: DailyQuota, queue: LaneQueue, prefixes: PrefixRouter, held: HeldUnits,
                 metrics: GatewayMetrics | None = None, screen: RequestScreen | None = None,
                 tokenizers: TokenCounter | None = None, cold_start_timeout_s: float = 600.0) -> None:
        self._pools = pools
        self._router = router
        self._replies = replies
        self._queue = queue
        self._prefixes = prefixes
        self._ledger = ledger
        self._plans = plans
        self._quota = quota
        self._held = held
        self._background: set[asyncio.Future[None]] = set()
        self._metrics = metrics or GatewayMetrics()
        self._screen = screen
        self._tokenizers = tokenizers
        # How long a request admitted with no warm worker waits for one to take it (see _first_replies).
        self._cold_start_ms = int(cold_start_timeout_s * 1000)

    async def handle(self, endpoint: Endpoint, raw: bytes, caller: Caller, call: Call) -> Answer:
        kind = KINDS[endpoint]
        body, parsed = parse_body(endpoint, raw)
        now = datetime.now(UTC)
        terms = await self._plans.terms(caller.account, now)
        call.label(plan=terms.plan.name, lane=terms.plan.lane.value)
        check_caps(parsed, terms, len(raw), kind.check_caps)
        check_key_allows(parsed, caller.key)
        if self._screen is not None:  # image hosts that resolve to private addresses; grammar floods
            await self._screen.check(caller.account_id, parsed)
        entry = (await self._pools.catalog()).get(parsed.model)
        check_capabilities(parsed, entry, kind.embeds)  # tools, media, reasoning, embeddings the model lacks: 400
        if entry is not None and not entry.allows_plan(terms.plan.name):
            raise APIError(403, f"The model '{parsed.model}' is not offered on the {terms.plan.name} plan.",
                           param="model", code="model_not_allowed")
        pool = await self._pools.route(parsed.model, terms.pool)
        # The model's context and the plan's input cap, before anything is counted: only a long prompt
        # waits for a tokenizer.
        await kind.check_input(parsed, terms.plan, pool, self._tokenizers)
        deadline_ms = deadline_ms_of(call.headers, now)
        call.label(model=pool.model)
        for name in _RESERVED_FIELDS:
            body.pop(name, None)
        cap = terms.plan.max_output_tokens
        if cap is not None and kind.output_param is not None and parsed.output_tokens() is None:
            # Without a limit of its own a request would run to the end of the context: the plan's
            # cap is its limit.
            body[kind.output_param] = min(
                cap, pool.max_model_len or cap)
        idempotency_key = idempotency_key_of(call.headers)
        body_sha256 = hashlib.sha256(raw).hexdigest() if idempotency_key else None
        if idempotency_key:
            existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key)
            if existing is not None and not expired(existing, now) and not await self._lost(existing, body_sha256):
                return await self._replay(existing, body_sha256, call)
            if existing is not None:
                await self._ledger.release_idempotency_key(existing.id)

        if self._ledger.unreachable_until and time.monotonic() < self._ledger.unreachable_until:
            raise _ledger_unavailable()  # its row could not be written: refused before it is counted
        window = quota_window(terms.plan.timezone, now)
        admission = Admission(new_request_id(), int(now.timestamp() * 1000), caller.account_id, window.day,
                              model=pool.model, lane=terms.plan.lane.value, keep_reply=idempotency_key is not None,
                              key_id=caller.key_id)
        bind(request_id=admission.request_id, account=caller.account_name)
        charge = Charge(plan=terms.plan.name, price_micros=terms.plan.price_per_request_micros, quota_day=window.day)
        row = {"request_id": admission.request_id, "account_id": caller.account_id, "api_key_id": caller.key_id,
               "model": pool.model, "endpoint": endpoint.value, "stream": bool(parsed.stream), "created_at": now,
               "charge": charge, "idempotency_key": idempotency_key, "body_sha256": body_sha256}
        if idempotency_key:
            # The row must exist before the job: its unique key decides which of two racing
            # requests runs and which one replays.
            try:
                await self._ledger.open(**row)
            except DuplicateIdempotencyKey:
                existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key)
                return await self._replay(existing, body_sha256, call)
            except DATABASE_DOWN:
                raise _ledger_unavailable() from None
        prefix = prefix_hash(endpoint, body) if self._prefixes.enabled else ""
        inbox = self._router.follow(admission.request_id) if idempotency_key else self._router.open(admission.request_id)
        job = Job(request_id=admission.request_id, endpoint=endpoint, body=orjson.dumps(body).decode(),
                  enqueued_ms=admission.created_ms, lane=terms.plan.lane, deadline_ms=deadline_ms, prefix=prefix,
                  reply_to="" if idempotency_key else self._router.stream, account_id=caller.account_id,
                  key_id=caller.key_id)
        # An in-flight entry left by a process that died stops counting once the request would have
        # timed out anyway.
        inflight_expires_ms = admission.created_ms + int((self._router.timeout_s + INFLIGHT_SLACK_S) * 1000)
        claim = QuotaClaim(caller.account_id, window.day, terms.daily_limit, expiry(window.resets_at),
                           caller.key_id, caller.key.daily_limit, terms.max_inflight, caller.key.max_inflight,
                           inflight_expires_ms)
        try:
            routed = await self._prefixes.target(pool.name, prefix, pool.workers)
            admitted = await self._queue.admit(job, pool.name, claim, routed)
        except BaseException as exc:
            self._router.close(inbox)
            if not isinstance(exc, (QuotaSpent, TooManyInFlight, APIError)):  # the script may have run before Redis went away
                self._held.give_back_later(caller.account_id, window.day, admission.request_id, "", caller.key_id)
            if idempotency_key:  # its row is open: close it, free
                code, status = ((exc.code, exc.status) if isinstance(exc, APIError) else ("not_queued", 503))
                await self._ledger.close(admission.request_id, Outcome(RequestStatus.FAILED, status, error_code=code,
                                                                       billable=False))
            if isinstance(exc, QuotaSpent) and not isinstance(exc, KeyQuotaSpent):
                self._metrics.quota_rejected(terms.plan.name)
            raise refusal(exc, terms, window, now, caller) from None
        admission = replace(admission, generation=admitted.generation)
        self._router.admitted(inbox, contract.inflight_key(caller.account_id), admission.request_id,
                              admitted.generation)
        call.ratelimit = ratelimit_headers(terms.daily_limit, admitted.used, window, now)
        if caller.key.daily_limit is not None:
            call.ratelimit = {**call.ratelimit, **key_ratelimit(caller.key.daily_limit, admitted.key_used)}
        # The row is written while the job runs; no answer leaves before it is committed.
        opening = None if idempotency_key else self._ledger.start_open(**row)
        # A cold request's job is withdrawn if no engine comes up for it in time, like a queue deadline.
        cold_until_ms = admission.created_ms + self._cold_start_ms if pool.cold else 0
        return await self._relay(admission, inbox, call, opening=opening,
                                 queued=admitted.queued if deadline_ms or cold_until_ms else None,
                                 deadline_ms=deadline_ms, cold_until_ms=cold_until_ms)

    async def _give_back(self, admission: Admission) -> None:
        try:
            await self._quota.give_back(admission.account_id, admission.quota_day, admission.request_id,
                                        self._held.key, admission.generation, admission.key_id)
        except QuotaUnavailable:
            log.warning("giving back the unit of %s waits for Redis", admission.request_id)
            self._held.give_back_later(admission.account_id, admission.quota_day, admission.request_id,
                                       admission.generation, admission.key_id)

    async def _settle(self, admission: Admission, outcome: Outcome) -> None:
        """Close the ledger row, then settle the unit: a charged request releases it, a free one gives
        it back. While the database is away the answer does not wait for it: the row closes (and
        the unit is settled) when it is back, and until then the unit stays held, so a gateway that
        dies meanwhile still has it settled by the reaper."""
        if not admission.owner:
            return
        closing = self._ledger.start_close(admission.request_id, outcome)
        self._metrics.finished(admission.model, admission.lane, outcome.status.value, queue_ms=outcome.queue_ms,
                               prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)
        if admission.keep_reply:
            with contextlib.suppress(RedisError):
                await self._replies.keep(admission.request_id, IDEMPOTENCY_WINDOW_S)
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await asyncio.shield(closing)
        except TimeoutError:
            log.warning("the ledger row of %s closes when the database is back", admission.request_id)
            closing.add_done_callback(lambda _f: self._later(self._settle_unit(admission, outcome, closing)))
            return
        except Exception:  # noqa: BLE001 - bookkeeping must not break an answer already given
            log.exception("closing the ledger row of %s failed; its unit stays held", admission.request_id)
            return
        await self._settle_unit(admission, outcome, closing)

    async def _settle_unit(self, admission: Admission, outcome: Outcome, closed: asyncio.Future[None]) -> None:
        if closed.cancelled() or closed.exception() is not None:
            return  # the row is still open: the unit stays held
        if outcome.billable:
            self._held.release(admission.request_id)
        else:
            await self._give_back(admission)

    def _later(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abandon(self, admission: Admission, status: RequestStatus, http_status: int, code: str,
                       billable: bool) -> None:
        if admission.owner:
            with contextlib.suppress(RedisError):
                await self._replies.cancel(admission.request_id)
            # It ends without its worker's terminal reply, which is what takes a request out of its
            # in-flight sets otherwise.
            self._held.ended(admission.request_id, admission.account_id, admission.key_id)
        await self._settle(admission, Outcome(status, http_status, duration_ms=_now_ms() - admission.created_ms,
                                              error_code=code, billable=billable))

    async def _lost(self, existing: RequestRecord, body_sha256: str | None) -> bool:
        """The same request was lost, free, before any answer: with its gateway, or its job with Redis's
        data. Its key may run it again."""
        if existing.body_sha256 != body_sha256 or existing.billable:
            return False
        if existing.error_code == JOB_LOST:
            return True
        return existing.error_code == LOST_CODE and not await self._replies.has_replies(existing.id)

    async def _replay(self, existing: RequestRecord | None, body_sha256: str | None, call: Call) -> Answer:
        if existing is None:
            raise APIError(409, "This Idempotency-Key is in use by another request; retry shortly.",
                           code="idempotency_key_in_use")
        if existing.body_sha256 != body_sha256:
            raise APIError(409, "This Idempotency-Key was already used with a different request body.",
                           param="Idempotency-Key", code="idempotency_key_reused")
        if not await self._replies.has_replies(existing.id):
            raise APIError(409, f"The request {existing.id} with this Idempotency-Key ended ({existing.status}); "
                           "its result is no longer available.", code="idempotency_result_gone")
        admission = Admission(existing.id, int(existing.created_at.timestamp() * 1000), existing.account_id,
                              existing.quota_day or "", owner=False, keep_reply=True)
        return await self._relay(admission, self._router.follow(existing.id), call)

    async def _relay(self, admission: Admission, inbox: Inbox, call: Call, *,
                     opening: asyncio.Future[None] | None = None, queued: Queued | None = None,
                     deadline_ms: int = 0, cold_until_ms: int = 0) -> Answer:
        headers = {"x-request-id": admission.request_id}
        call.watch(inbox.leave)
        handed_over = False
        try:
            batch = await self._first_replies(admission, inbox, call, queued, deadline_ms, cold_until_ms)
            if opening is not None:
                await self._recorded(admission, opening)
            if batch is None:
                await self._abandon(admission, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed", billable=False)
                return Answer(CLIENT_CLOSED, headers)
            first = batch[0]
            if first.started_ms:
                headers["x-flatfare-queue-ms"] = str(max(first.started_ms - admission.created_ms, 0))
            if cold_until_ms:  # admitted with no warm worker: how long the model took to take it
                taken_ms = first.started_ms or _now_ms()
                headers["x-flatfare-model-wait-ms"] = str(max(taken_ms - admission.created_ms, 0))
            if admission.owner and (first.kind is ReplyKind.CHUNK
                                    or (first.kind is ReplyKind.RESPONSE and first.status < 400)):
                self._metrics.first_token(admission.model, admission.lane, (_now_ms() - admission.created_ms) / 1000)
            if first.kind.terminal:
                return self._whole(admission, first, headers)
            handed_over = True
            call.watch_client()
            return Answer(200, {**headers, **_SSE_HEADERS}, _SSE, stream=self._sse(admission, inbox, batch))
        finally:
            if not handed_over:
                self._router.close(inbox)

    async def _recorded(self, admission: Admission, opening: asyncio.Future[None]) -> None:
        """Wait for the request's ledger row; without it the request is withdrawn, free."""
        try:
            await self._ledger.opened(opening)
        except DATABASE_DOWN:
            with contextlib.suppress(RedisError):
                await self._replies.cancel(admission.request_id)
            self._held.ended(admission.request_id, admission.account_id, admission.key_id)
            await self._give_back(admission)
            raise _ledger_unavailable() from None

    async def _first_replies(self, admission: Admission, inbox: Inbox, call: Call, queued: Queued | None,
                             deadline_ms: int, cold_until_ms: int = 0) -> list[Reply] | None:
        """The first replies, or None if the client left first (the caller cancels the job).

        Past the client's queue deadline, a job no worker has taken yet is withdrawn: 429, free. So is
        a cold request's past the cold start's bound: 503, free, saying why no engine came up."""
        timeout_at = admission.created_ms + int(self._router.timeout_s * 1000)
        withdraw_at = min(at for at in (deadline_ms, cold_until_ms) if at) if queued is not None else 0
        watching = False
        while True:
            wake_at = min(timeout_at, withdraw_at) if queued is not None else timeout_at
            wait_s = max(wake_at - _now_ms(), 0) / 1000
            batch = await inbox.next(wait_s if watching else min(wait_s, WATCH_AFTER_S))
            if batch:
                return batch
            if call.gone:
                return None
            if not watching:
                watching = True
                call.watch_client()
                continue
            if queued is not None and _now_ms() >= withdraw_at:
                if await self._queue.withdraw(queued):
                    if deadline_ms and _now_ms() >= deadline_ms:
                        refused = APIError(429, "The request waited in the queue past its x-flatfare-max-queue-ms "
                                           "deadline; it was not run and costs nothing.",
                                           code="queue_deadline_exceeded", headers={"Retry-After": "1"})
                    else:
                        refused = await self._cold_start_failed(admission, queued.pool)
                    refused.headers["x-request-id"] = admission.request_id
                    await self._abandon(admission, RequestStatus.FAILED, refused.status, refused.code or "",
                                        billable=False)
                    raise refused
                queued = None  # a worker has it: no deadline any more
                continue
            if _now_ms() >= timeout_at:
                exc = timed_out()
                await self._abandon(admission, RequestStatus.FAILED, exc.status, exc.code or "timeout", billable=False)
                raise exc

    async def _cold_start_failed(self, admission: Admission, pool: str) -> APIError:
        try:
            reason = await self._pools.cold_start_reason(admission.model, pool)
        except RedisError:  # the job is withdrawn already: the answer goes without the fleet's word
            reason = None
        return APIError(503, f"The model '{admission.model}' did not come up within {self._cold_start_ms / 1000:g} s"
                        f" ({reason or 'no engine of it became ready, and no fleet supervisor said why'}); "
                        "the request was not run and costs nothing. Retry later.", param="model",
                        code="model_cold_start_timeout", headers={"Retry-After": "30"})

    def _whole(self, admission: Admission, reply: Reply, headers: dict[str, str]) -> Answer:
        outcome = _outcome(reply, admission.created_ms, _now_ms())

        async def finish() -> None:
            await self._settle(admission, outcome)

        # A stream that ends at once (END first) still owes the client its [DONE].
        if reply.kind is ReplyKind.END:
            return Answer(reply.status, headers, _SSE, _DONE, after=finish)
        return Answer(reply.status, headers, _JSON, reply.data.encode(), after=finish)

    async def _sse(self, admission: Admission, inbox: Inbox, first: list[Reply]) -> AsyncIterator[bytes]:
        last = first[0]
        timed_out_ = False
        timeout_at = admission.created_ms + int(self._router.timeout_s * 1000)
        try:
            batch = first
            while True:
                events = []
                for reply in batch:
                    last = reply
                    if reply.kind is ReplyKind.CHUNK:
                        events.append(_event(reply.data))
                    elif reply.kind is ReplyKind.ERROR:  # the worker failed mid-stream
                        events.append(_event(reply.data) + _DONE)
                    else:
                        events.append(_DONE)
                yield b"".join(events)  # what arrived together leaves in one write
                if last.kind.terminal or inbox.gone:
                    break
                batch = await inbox.next(max(timeout_at - _now_ms(), 0) / 1000)
                if not batch and not inbox.gone:  # no terminal reply before the deadline
                    timed_out_ = True
                    exc = timed_out()
                    yield _event(orjson.dumps(error_body(exc.status, exc.message, code=exc.code)).decode()) + _DONE
                    break
        finally:
            self._router.close(inbox)
            # Runs when the client leaves too: shield the bookkeeping. Output was already produced
            # here, so the request is charged whatever happens next.
            await asyncio.shield(self._end_stream(admission, last, timed_out_))

    async def _end_stream(self, admission: Admission, last: Reply, timed_out_: bool) -> None:
        if timed_out_:
            await self._abandon(admission, RequestStatus.FAILED, 504, "timeout", billable=True)
        elif last.kind.terminal:
            # Chunks went out before this terminal reply: output was produced, so it is charged.
            await self._settle(admission, _outcome(last, admission.created_ms, _now_ms(), produced=True))
        else:
            await self._abandon(admission, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed", billable=True)


def _ledger_unavailable() -> APIError:
    return APIError(503, "The ledger is unreachable; retry shortly.", code="ledger_unavailable",
                    headers={"Retry-After": "1"})


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"
