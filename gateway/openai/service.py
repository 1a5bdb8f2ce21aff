"""One job-kind request through the platform: admitted, counted and queued, recorded, answered.

The phases are a module each: :mod:`.admission` (what makes a request admissible: everything a
client can get wrong is refused there, before the ledger or the queue see the request), this module
(the idempotency key, the one admission script that counts the quota and queues the job, the
ledger row), :mod:`.relay` (the worker's replies to the client) and :mod:`.settlement` (the row
closed, the unit released or given back). The service knows nothing of HTTP:
:mod:`flatfare.gateway.openai.asgi` hands it the body, the caller and a :class:`~.relay.Call` (the
few headers it reads, the client's presence) and sends the :class:`~.relay.Answer` back.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime

from flatfare.billing.held import LOST_CODE, HeldUnits
from flatfare.billing.ledger import Charge, DuplicateIdempotencyKey, Ledger, Outcome
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import expiry
from flatfare import contract
from flatfare.contract import Endpoint, Job
from flatfare.logs import bind
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import RequestRecord, RequestStatus
from flatfare.gateway.auth import Caller
from flatfare.gateway.errors import APIError
from flatfare.gateway.metrics import GatewayMetrics
from flatfare.gateway.openai.admission import Admissible, Admission
from flatfare.gateway.openai.checks import deadline_ms_of, expired, idempotency_key_of
from flatfare.gateway.openai.kinds import Turn
from flatfare.gateway.openai.refusals import key_ratelimit, refusal
from flatfare.gateway.openai.relay import Answer, Call, Relay, Waiting
from flatfare.gateway.openai.settlement import Accepted, Settlement, ledger_unavailable
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.jobpath.prefix_routing import PrefixRouter, prefix_hash
from flatfare.gateway.jobpath.queueing import KeyQuotaSpent, LaneQueue, QuotaClaim, QuotaSpent, TooManyInFlight
from flatfare.gateway.quota_headers import ratelimit_headers
from flatfare.gateway.shared_keys import SharedKeys
from flatfare.gateway.jobpath.replies import JOB_LOST, Replies, ReplyRouter

# An in-flight entry outlives its request's timeout by this much before it stops counting.
INFLIGHT_SLACK_S = 60.0


def new_request_id() -> str:
    return uuid.uuid4().hex


class CompletionService:
    def __init__(self, admission: Admission, plans: PlanBook, router: ReplyRouter, replies: Replies,
                 ledger: Ledger, queue: LaneQueue, prefixes: PrefixRouter, held: HeldUnits, settlement: Settlement,
                 relay: Relay, metrics: GatewayMetrics, shared_keys: SharedKeys | None = None) -> None:
        self.admission = admission
        self._plans = plans
        self._router = router
        self._replies = replies
        self._ledger = ledger
        self._queue = queue
        self._prefixes = prefixes
        self._held = held
        self._settlement = settlement
        self._relay = relay
        self._metrics = metrics
        # Shared-key detection: what the admission script records of each key's client (None: nothing).
        self._shared_keys = shared_keys
        # How long a request admitted with no warm worker waits for one to take it.
        self._cold_start_ms = relay.cold_start_ms

    async def handle(self, endpoint: Endpoint, raw: bytes, caller: Caller, call: Call) -> Answer:
        now = datetime.now(UTC)
        if call.spans is not None:  # ends once its job is queued, or with its refusal
            call.spans.begin("admission")
        terms = await self._plans.terms(caller.account, now)
        call.label(plan=terms.plan.name, lane=terms.plan.lane.value)
        request = await self.admission.check(endpoint, raw, caller, terms, label=call.label)
        deadline_ms = deadline_ms_of(call.headers, now)
        idempotency_key = idempotency_key_of(call.headers)
        body_sha256 = hashlib.sha256(raw).hexdigest() if idempotency_key else None
        if idempotency_key:
            existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key)
            if existing is not None and not expired(existing, now, self._settlement.idempotency_window_s) and not await self._lost(existing, body_sha256):
                return await self._replay(existing, body_sha256, call, request.turn)
            if existing is not None:
                await self._ledger.release_idempotency_key(existing.id)
        if self._ledger.unreachable_until and time.monotonic() < self._ledger.unreachable_until:
            raise ledger_unavailable()  # its row could not be written: refused before it is counted
        return await self._take(request, caller, call, now, deadline_ms, idempotency_key, body_sha256)

    async def _take(self, request: Admissible, caller: Caller, call: Call, now: datetime, deadline_ms: int,
                    idempotency_key: str | None, body_sha256: str | None) -> Answer:
        """Count the request and queue its job (one script), record it, and relay its answer."""
        terms, pool = request.terms, request.pool
        window = quota_window(terms.plan.timezone, now)
        accepted = Accepted(new_request_id(), int(now.timestamp() * 1000), caller.account_id, window.day,
                            model=pool.model, lane=terms.plan.lane.value, plan=terms.plan.name,
                            keep_reply=idempotency_key is not None,
                            key_id=caller.key_id, spans=call.spans)
        bind(request_id=accepted.request_id, account=caller.account_name)
        charge = Charge(plan=terms.plan.name, price_micros=terms.plan.price_per_request_micros, quota_day=window.day)
        row = {"request_id": accepted.request_id, "account_id": caller.account_id, "api_key_id": caller.key_id,
               "model": pool.model, "endpoint": request.endpoint.value, "stream": bool(request.parsed.stream),
               "created_at": now, "charge": charge, "idempotency_key": idempotency_key, "body_sha256": body_sha256}
        if idempotency_key:
            # The row must exist before the job: its unique key decides which of two racing
            # requests runs and which one replays.
            try:
                await self._ledger.open(**row)
            except DuplicateIdempotencyKey:
                existing = await self._ledger.find_idempotent(caller.account_id, idempotency_key)
                return await self._replay(existing, body_sha256, call, request.turn)
            except DATABASE_DOWN:
                raise ledger_unavailable() from None
        prefix = prefix_hash(request.endpoint, request.body) if self._prefixes.enabled else ""
        inbox = self._router.follow(accepted.request_id) if idempotency_key else self._router.open(accepted.request_id)
        job = Job(request_id=accepted.request_id, endpoint=request.endpoint, body=request.job_body(),
                  enqueued_ms=accepted.created_ms, lane=terms.plan.lane, deadline_ms=deadline_ms, prefix=prefix,
                  reply_to="" if idempotency_key else self._router.stream, account_id=caller.account_id,
                  key_id=caller.key_id, traceparent=call.traceparent)
        # An in-flight entry left by a process that died stops counting once the request would have
        # timed out anyway.
        inflight_expires_ms = accepted.created_ms + int((self._router.timeout_s + INFLIGHT_SLACK_S) * 1000)
        sighting = (self._shared_keys.sighting(call.client, call.headers.get("user-agent", ""), terms.plan, now)
                    if self._shared_keys is not None and caller.key_id is not None else None)
        claim = QuotaClaim(caller.account_id, window.day, terms.daily_limit, expiry(window.resets_at),
                           caller.key_id, caller.key.daily_limit, terms.max_inflight, caller.key.max_inflight,
                           inflight_expires_ms, sighting)
        try:
            routed = await self._prefixes.target(pool.name, prefix, pool.workers)
            admitted = await self._queue.admit(job, pool.name, claim, routed)
        except BaseException as exc:
            self._router.close(inbox)
            if not isinstance(exc, (QuotaSpent, TooManyInFlight, APIError)):  # the script may have run before Redis went away
                self._held.give_back_later(caller.account_id, window.day, accepted.request_id, "", caller.key_id)
            if idempotency_key:  # its row is open: close it, free
                code, status = ((exc.code, exc.status) if isinstance(exc, APIError) else ("not_queued", 503))
                await self._ledger.close(accepted.request_id, Outcome(RequestStatus.FAILED, status, error_code=code,
                                                                      billable=False))
            if isinstance(exc, QuotaSpent) and not isinstance(exc, KeyQuotaSpent):
                self._metrics.quota_rejected(terms.plan.name)
            raise refusal(exc, terms, window, now, caller) from None
        accepted = replace(accepted, generation=admitted.generation)
        if call.spans is not None:
            call.spans.end("admission", **{"flatfare.request_id": accepted.request_id, "flatfare.pool": pool.name,
                                           "flatfare.lane": terms.plan.lane.value})
            call.spans.begin("relay")  # to the answer's last byte (the worker's spans are in between)
        self._router.admitted(inbox, contract.inflight_key(caller.account_id), accepted.request_id,
                              admitted.generation)
        call.ratelimit = ratelimit_headers(terms.daily_limit, admitted.used, window, now)
        if caller.key.daily_limit is not None:
            call.ratelimit = {**call.ratelimit, **key_ratelimit(caller.key.daily_limit, admitted.key_used)}
        # The row is written while the job runs; no answer leaves before it is committed.
        opening = None if idempotency_key else self._ledger.start_open(**row)
        # A cold request's job is withdrawn if no engine comes up for it in time, like a queue deadline.
        cold_until_ms = accepted.created_ms + self._cold_start_ms if pool.cold else 0
        waiting = Waiting(admitted.queued if deadline_ms or cold_until_ms else None, deadline_ms, cold_until_ms)
        return await self._relay.answer(accepted, inbox, call, request.turn, opening=opening, waiting=waiting)

    async def _lost(self, existing: RequestRecord, body_sha256: str | None) -> bool:
        """The same request was lost, free, before any answer: with its gateway, or its job with Redis's
        data. Its key may run it again."""
        if existing.body_sha256 != body_sha256 or existing.billable:
            return False
        if existing.error_code == JOB_LOST:
            return True
        return existing.error_code == LOST_CODE and not await self._replies.has_replies(existing.id)

    async def _replay(self, existing: RequestRecord | None, body_sha256: str | None, call: Call,
                      turn: Turn | None) -> Answer:
        if existing is None:
            raise APIError(409, "This Idempotency-Key is in use by another request; retry shortly.",
                           code="idempotency_key_in_use")
        if existing.body_sha256 != body_sha256:
            raise APIError(409, "This Idempotency-Key was already used with a different request body.",
                           param="Idempotency-Key", code="idempotency_key_reused")
        if not await self._replies.has_replies(existing.id):
            raise APIError(409, f"The request {existing.id} with this Idempotency-Key ended ({existing.status}); "
                           "its result is no longer available.", code="idempotency_result_gone")
        accepted = Accepted(existing.id, int(existing.created_at.timestamp() * 1000), existing.account_id,
                            existing.quota_day or "", owner=False, keep_reply=True)
        return await self._relay.answer(accepted, self._router.follow(existing.id), call, turn)
