"""One completion request through the platform: validate, route, record, queue, answer.

Everything a client can get wrong is refused here, before the ledger or the queue see the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sqlalchemy.exc import SQLAlchemyError

from billing.ledger import Charge, DuplicateIdempotencyKey, Ledger, Outcome
from billing.plans import AccountTerms, QuotaWindow, quota_window
from billing.quota import DailyQuota, Decision, QuotaUnavailable
from flatfare.contract import Endpoint, Job, Reply, ReplyKind
from flatfare.logs import bind
from flatfare.storage.models import RequestStatus
from gateway.auth import Caller
from gateway.errors import APIError, error_body, invalid, validation_error
from gateway.metrics import GatewayMetrics, label_request
from flatfare.storage.models import RequestRecord
from gateway.plans import PlanBook
from gateway.pools import Pool, Pools
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.ratelimit import ratelimit_headers
from gateway.affinity import PrefixRouter, prefix_hash
from gateway.queueing import LaneQueue, Queued
from gateway.replies import Dispatcher

log = logging.getLogger("flatfare.gateway")

_MODELS = {Endpoint.CHAT: ChatCompletionRequest, Endpoint.COMPLETION: CompletionRequest}
# Fields only the platform sets: the engine's request id and scheduling priority.
_RESERVED_FIELDS = ("request_id", "priority")
_JSON = "application/json"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499
IDEMPOTENCY_WINDOW_S = 24 * 3600
MAX_IDEMPOTENCY_KEY = 255


def new_request_id() -> str:
    return uuid.uuid4().hex


def parse_body(endpoint: Endpoint, raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request. Send a JSON object "
                       "with 'Content-Type: application/json'.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    try:
        parsed = _MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise validation_error(list(exc.errors()), body) from None
    return body, parsed


def check_fits(parsed: ChatCompletionRequest | CompletionRequest, pool: Pool) -> None:
    wanted = parsed.output_tokens()
    if wanted is not None and wanted > pool.max_model_len:
        param = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise invalid(f"{param} is too large: {wanted}. The model '{pool.model}' supports at most "
                      f"{pool.max_model_len} tokens of context.", param=param)


def check_caps(parsed: ChatCompletionRequest | CompletionRequest, terms: AccountTerms, body_bytes: int) -> None:
    """The plan's per-request caps, checked before any quota unit is counted."""
    plan = terms.plan
    if body_bytes > plan.max_body_bytes:
        raise APIError(413, f"The request body is larger than the {plan.name} plan's limit of "
                       f"{plan.max_body_bytes} bytes.", code="request_too_large")
    if not plan.allows_model(parsed.model):
        raise APIError(403, f"The {plan.name} plan does not include the model '{parsed.model}'.",
                       param="model", code="model_not_allowed")
    if (parsed.n or 1) > plan.max_n:
        raise invalid(f"n is {parsed.n}; the {plan.name} plan allows at most {plan.max_n}.", param="n")
    wanted = parsed.output_tokens()
    if plan.max_output_tokens is not None and wanted is not None and wanted > plan.max_output_tokens:
        param = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise invalid(f"{param} is {wanted}; the {plan.name} plan allows at most {plan.max_output_tokens} "
                      "output tokens per request.", param=param)


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


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


class CompletionService:
    def __init__(self, pools: Pools, dispatcher: Dispatcher, ledger: Ledger, plans: PlanBook,
                 quota: DailyQuota, queue: LaneQueue, router: PrefixRouter,
                 metrics: GatewayMetrics | None = None) -> None:
        self._pools = pools
        self._dispatcher = dispatcher
        self._queue = queue
        self._router = router
        self._ledger = ledger
        self._plans = plans
        self._quota = quota
        self._metrics = metrics or GatewayMetrics()

    async def handle(self, endpoint: Endpoint, raw: bytes, caller: Caller, request: Request) -> Response:
        body, parsed = parse_body(endpoint, raw)
        now = datetime.now(UTC)
        terms = await self._plans.terms(caller.account, now)
        label_request(request, plan=terms.plan.name, lane=terms.plan.lane.value)
        check_caps(parsed, terms, len(raw))
        entry = (await self._pools.catalog()).get(parsed.model)
        if entry is not None and not entry.allows_plan(terms.plan.name):
            raise APIError(403, f"The model '{parsed.model}' is not offered on the {terms.plan.name} plan.",
                           param="model", code="model_not_allowed")
        pool = await self._pools.route(parsed.model, terms.pool)
        check_fits(parsed, pool)
        deadline_ms = _deadline(request, now)
        label_request(request, model=pool.model)
        for field in _RESERVED_FIELDS:
            body.pop(field, None)
        idempotency_key = _idempotency_key(request)
        body_sha256 = hashlib.sha256(raw).hexdigest() if idempotency_key else None
        if idempotency_key:
            existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key)
            if existing is not None and not _expired(existing, now):
                return await self._replay(existing, body_sha256, request)
            if existing is not None:
                await self._ledger.release_idempotency_key(existing.id)

        window = quota_window(terms.plan.timezone, now)
        decision = await self._count(caller, terms, window, now)
        request.state.ratelimit = ratelimit_headers(decision.limit, decision.used, window, now)
        admission = Admission(new_request_id(), int(now.timestamp() * 1000), caller.account_id, window.day,
                              model=pool.model, lane=terms.plan.lane.value)
        bind(request_id=admission.request_id, account=caller.account_name)
        charge = Charge(plan=terms.plan.name, price_micros=terms.plan.price_per_request_micros, quota_day=window.day)
        try:
            await self._ledger.open(
                request_id=admission.request_id, account_id=caller.account_id, api_key_id=caller.key_id,
                model=pool.model, endpoint=endpoint.value, stream=bool(parsed.stream), created_at=now,
                charge=charge, idempotency_key=idempotency_key, body_sha256=body_sha256)
        except DuplicateIdempotencyKey:
            # A concurrent request with the same key won the race: answer as its replay.
            await self._give_back(admission)
            existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key or "")
            return await self._replay(existing, body_sha256, request)
        except SQLAlchemyError:
            await self._give_back(admission)
            raise APIError(503, "The ledger is unreachable; retry shortly.", code="ledger_unavailable",
                           headers={"Retry-After": "1"}) from None
        prefix = prefix_hash(endpoint, body) if self._router.enabled else ""
        job = Job(request_id=admission.request_id, endpoint=endpoint, body=orjson.dumps(body).decode(),
                  enqueued_ms=admission.created_ms, lane=terms.plan.lane, deadline_ms=deadline_ms, prefix=prefix)
        try:
            routed = await self._router.target(pool.name, prefix, pool.workers)
            queued = await self._queue.submit(job, pool.name, routed)
        except APIError as exc:  # the lane is full: refused at once, and free
            await self._settle(admission, Outcome(RequestStatus.FAILED, exc.status, error_code=exc.code,
                                                  billable=False), keep_reply=False)
            raise
        except RedisError:
            await self._settle(admission, Outcome(RequestStatus.FAILED, 503, error_code="queue_unavailable",
                                                  billable=False), keep_reply=False)
            raise APIError(503, "The request queue is unreachable; retry shortly.", code="queue_unavailable",
                           headers={"Retry-After": "1"}) from None
        return await self._relay(admission, request, keep_reply=idempotency_key is not None,
                                 queued=queued if deadline_ms else None, deadline_ms=deadline_ms)

    async def _count(self, caller: Caller, terms: AccountTerms, window: QuotaWindow, now: datetime) -> Decision:
        try:
            decision = await self._quota.take(caller.account_id, window.day, terms.daily_limit, window.resets_at)
        except QuotaUnavailable:
            raise APIError(503, "Request quotas cannot be checked right now; retry shortly.",
                           code="quota_unavailable", headers={"Retry-After": "1"}) from None
        if not decision.allowed:
            self._metrics.quota_rejected(terms.plan.name)
            seconds = window.seconds_left(now)
            raise APIError(
                429, f"You have used all {terms.daily_limit} requests of your {terms.plan.name} plan for today "
                f"({window.day}); the allowance resets in {seconds} s.", code="rate_limit_exceeded",
                headers={"Retry-After": str(seconds),
                         **ratelimit_headers(decision.limit, decision.used, window, now)})
        return decision

    async def _give_back(self, admission: Admission) -> None:
        try:
            await self._quota.give_back(admission.account_id, admission.quota_day)
        except QuotaUnavailable:
            log.error("could not give back the quota unit of %s: Redis is unreachable", admission.request_id)

    async def _settle(self, admission: Admission, outcome: Outcome, *, keep_reply: bool) -> None:
        """Close the ledger row, give the unit back if nothing was produced, tidy the reply stream."""
        if not admission.owner:
            return
        await self._ledger.close(admission.request_id, outcome)
        self._metrics.finished(admission.model, admission.lane, outcome.status.value, queue_ms=outcome.queue_ms,
                               prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)
        if not outcome.billable:
            await self._give_back(admission)
        with contextlib.suppress(RedisError):
            await self._dispatcher.finish(admission.request_id, keep_s=IDEMPOTENCY_WINDOW_S if keep_reply else 0)

    async def _abandon(self, admission: Admission, status: RequestStatus, http_status: int, code: str,
                       billable: bool, keep_reply: bool) -> None:
        if admission.owner:
            with contextlib.suppress(RedisError):
                await self._dispatcher.cancel(admission.request_id)
        await self._settle(admission, Outcome(status, http_status, duration_ms=_now_ms() - admission.created_ms,
                                              error_code=code, billable=billable), keep_reply=keep_reply)

    async def _replay(self, existing: RequestRecord | None, body_sha256: str | None, request: Request) -> Response:
        if existing is None:
            raise APIError(409, "This Idempotency-Key is in use by another request; retry shortly.",
                           code="idempotency_key_in_use")
        if existing.body_sha256 != body_sha256:
            raise APIError(409, "This Idempotency-Key was already used with a different request body.",
                           param="Idempotency-Key", code="idempotency_key_reused")
        if not await self._dispatcher.has_replies(existing.id):
            raise APIError(409, f"The request {existing.id} with this Idempotency-Key ended ({existing.status}); "
                           "its result is no longer available.", code="idempotency_result_gone")
        admission = Admission(existing.id, int(existing.created_at.timestamp() * 1000), existing.account_id,
                              existing.quota_day or "", owner=False)
        return await self._relay(admission, request, keep_reply=True)

    async def _relay(self, admission: Admission, request: Request, *, keep_reply: bool,
                     queued: Queued | None = None, deadline_ms: int = 0) -> Response:
        headers = {"x-request-id": admission.request_id}
        replies = self._dispatcher.replies(admission.request_id)
        batch = await self._first_reply(admission, replies, request, keep_reply, queued, deadline_ms)
        if batch is None:
            return Response(status_code=CLIENT_CLOSED, headers=headers)
        first = batch[0]
        if first.started_ms:
            headers["x-flatfare-queue-ms"] = str(max(first.started_ms - admission.created_ms, 0))
        if admission.owner and (first.kind is ReplyKind.CHUNK
                                or (first.kind is ReplyKind.RESPONSE and first.status < 400)):
            self._metrics.first_token(admission.model, admission.lane, (_now_ms() - admission.created_ms) / 1000)
        if first.kind.terminal:
            return self._whole(admission, first, headers, keep_reply)
        return StreamingResponse(self._sse(admission, batch, replies, keep_reply),
                                 media_type="text/event-stream", headers={**headers, **_SSE_HEADERS})

    async def _first_reply(self, admission: Admission, replies: AsyncIterator[list[Reply]], request: Request,
                           keep_reply: bool, queued: Queued | None = None,
                           deadline_ms: int = 0) -> list[Reply] | None:
        """The first batch of replies, or None if the client left first (the job is then cancelled).

        Past the client's queue deadline, a job no worker has taken yet is withdrawn: 429, free."""
        reading = asyncio.ensure_future(anext(replies))
        leaving = asyncio.ensure_future(_client_gone(request))
        try:
            while True:
                timeout = max(deadline_ms - _now_ms(), 0) / 1000 if queued is not None else None
                done, _ = await asyncio.wait({reading, leaving}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
                if await self._queue.withdraw(queued):
                    await self._abandon(admission, RequestStatus.FAILED, 429, "queue_deadline_exceeded",
                                        billable=False, keep_reply=keep_reply)
                    raise APIError(429, "The request waited in the queue past its x-flatfare-max-queue-ms "
                                   "deadline; it was not run and costs nothing.", code="queue_deadline_exceeded",
                                   headers={"Retry-After": "1", "x-request-id": admission.request_id})
                queued = None  # a worker has it: no deadline any more
        finally:
            leaving.cancel()
            if not reading.done():
                reading.cancel()
        if reading.done() and not reading.cancelled():
            try:
                return reading.result()
            except APIError as exc:
                await self._abandon(admission, RequestStatus.FAILED, exc.status, exc.code or "timeout",
                                    billable=False, keep_reply=keep_reply)
                raise
        await self._abandon(admission, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed", billable=False,
                            keep_reply=keep_reply)
        return None

    def _whole(self, admission: Admission, reply: Reply, headers: dict[str, str], keep_reply: bool) -> Response:
        outcome = _outcome(reply, admission.created_ms, _now_ms())

        async def finish() -> None:
            await self._settle(admission, outcome, keep_reply=keep_reply)

        # A stream that ends at once (END first) still owes the client its [DONE].
        content = _DONE if reply.kind is ReplyKind.END else reply.data
        media_type = "text/event-stream" if reply.kind is ReplyKind.END else _JSON
        return Response(content=content, status_code=reply.status, media_type=media_type, headers=headers,
                        background=BackgroundTask(finish))

    async def _sse(self, admission: Admission, first: list[Reply], replies: AsyncIterator[list[Reply]],
                   keep_reply: bool) -> AsyncIterator[bytes]:
        last = first[0]
        timed_out = False
        try:
            batch: list[Reply] | None = first
            while batch is not None:
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
                batch = await anext(replies, None)
        except APIError as exc:  # no terminal reply before the deadline
            timed_out = True
            yield _event(orjson.dumps(error_body(exc.status, exc.message, code=exc.code)).decode()) + _DONE
        finally:
            # Runs when the client leaves too (the response task is cancelled): shield the bookkeeping.
            # Output was already produced here, so the request is charged whatever happens next.
            with anyio.CancelScope(shield=True):
                if timed_out:
                    await self._abandon(admission, RequestStatus.FAILED, 504, "timeout", billable=True,
                                        keep_reply=keep_reply)
                elif last.kind.terminal:
                    # Chunks went out before this terminal reply: output was produced, so it is charged.
                    await self._settle(admission, _outcome(last, admission.created_ms, _now_ms(), produced=True),
                                       keep_reply=keep_reply)
                else:
                    await self._abandon(admission, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed",
                                        billable=True, keep_reply=keep_reply)


MAX_QUEUE_DEADLINE_MS = 86_400_000


def _deadline(request: Request, now: datetime) -> int:
    """The wall-clock ms past which a still-queued job is dropped (x-flatfare-max-queue-ms); 0: none."""
    raw = request.headers.get("x-flatfare-max-queue-ms")
    if raw is None:
        return 0
    if not raw.strip().isdigit() or not 0 < int(raw) <= MAX_QUEUE_DEADLINE_MS:
        raise invalid(f"x-flatfare-max-queue-ms must be a whole number of milliseconds from 1 to "
                      f"{MAX_QUEUE_DEADLINE_MS}.", param="x-flatfare-max-queue-ms")
    return int(now.timestamp() * 1000) + int(raw)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    key = key.strip()
    if not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise invalid(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters.", param="Idempotency-Key")
    return key


def _expired(record: RequestRecord, now: datetime) -> bool:
    created = record.created_at if record.created_at.tzinfo else record.created_at.replace(tzinfo=UTC)
    return (now - created).total_seconds() > IDEMPOTENCY_WINDOW_S


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"
