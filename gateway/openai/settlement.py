"""How an admitted request ends: its ledger row closed, then its quota unit settled.

A request is charged once the engine produced output (:func:`billable`); one that failed before its
first token, was cancelled before any, timed out waiting or was withdrawn is free: its row closes
``billable = false`` and its unit goes back to the account's and the key's counters (through the
give-back script, at most once whoever gives it back). A charged request only releases its held unit.
What the row and its outbox and rollup rows hold is the ledger's (:mod:`flatfare.billing.ledger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import orjson
from redis.exceptions import RedisError

from flatfare.billing.held import HeldUnits
from flatfare.billing.ledger import Ledger, Outcome
from flatfare.billing.quota import DailyQuota, QuotaUnavailable
from flatfare.contract import Reply, ReplyKind
from flatfare.gateway.errors import APIError
from flatfare.gateway.metrics import GatewayMetrics
from flatfare.gateway.jobpath.replies import JOB_LOST, Replies
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import RequestStatus
from flatfare.tracing import Spans, now_ns

log = logging.getLogger("flatfare.gateway")

# How long an answer's end waits for its ledger row to close before leaving that to the background.
CLOSE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request the platform took on: what to undo or settle when it ends."""

    request_id: str
    created_ms: int
    account_id: int
    quota_day: str
    # False for a replay of an idempotent request: it neither owns the job nor pays again.
    owner: bool = True
    # For the metrics: the routed model, the plan and its lane.
    model: str = ""
    lane: str = ""
    plan: str = ""
    # The idempotent request's own reply stream is kept for replays.
    keep_reply: bool = False
    # The quota counters' generation its unit was counted in (see flatfare.billing.quota's give-back).
    generation: str = ""
    # The API key whose counter the unit counted too (None: a replay, which counted nothing).
    key_id: int | None = None
    # The request's spans in this process (flatfare.tracing; None: not traced): the settlement's are children.
    spans: Spans | None = field(default=None, compare=False)


def now_ms() -> int:
    return int(time.time() * 1000)


def billable(reply: Reply) -> bool:
    """A request is charged once the engine produced output; earlier failures give the unit back."""
    return reply.first_token_ms > 0 or (reply.kind is not ReplyKind.ERROR and reply.status < 400)


def outcome(reply: Reply, created_ms: int, finished_ms: int, produced: bool = False) -> Outcome:
    """The ledger's close of a request answered by ``reply``. ``produced``: output already went out
    (chunks of a stream), so it is charged whatever the last reply says."""
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
        billable=produced or billable(reply),
    )


def ledger_unavailable() -> APIError:
    return APIError(503, "The ledger is unreachable; retry shortly.", code="ledger_unavailable",
                    headers={"Retry-After": "1"})


class Settlement:
    def __init__(self, ledger: Ledger, quota: DailyQuota, held: HeldUnits, replies: Replies,
                 metrics: GatewayMetrics, idempotency_window_s: int) -> None:
        self._ledger = ledger
        # How long a request sent with an Idempotency-Key is replayed to a retry (its answer kept in Redis).
        self.idempotency_window_s = idempotency_window_s
        self._quota = quota
        self._held = held
        self._replies = replies
        self._metrics = metrics
        self._background: set[asyncio.Future[None]] = set()

    async def give_back(self, accepted: Accepted) -> None:
        try:
            await self._quota.give_back(accepted.account_id, accepted.quota_day, accepted.request_id,
                                        self._held.key, accepted.generation, accepted.key_id)
        except QuotaUnavailable:
            log.warning("giving back the unit of %s waits for Redis", accepted.request_id)
            self._held.give_back_later(accepted.account_id, accepted.quota_day, accepted.request_id,
                                       accepted.generation, accepted.key_id)

    async def settle(self, accepted: Accepted, result: Outcome) -> None:
        """Close the ledger row, then settle the unit: a charged request releases it, a free one gives
        it back. While the database is away the answer does not wait for it: the row closes (and
        the unit is settled) when it is back, and until then the unit stays held, so a gateway that
        dies meanwhile still has it settled by the reaper."""
        if not accepted.owner:
            return
        if accepted.spans is None:
            await self._settle(accepted, result)
            return
        started = now_ns()
        try:
            await self._settle(accepted, result)
        finally:
            accepted.spans.child("settlement", started, **{"flatfare.billable": result.billable,
                                                           "flatfare.outcome": result.status.value})

    async def _settle(self, accepted: Accepted, result: Outcome) -> None:
        closing = self._ledger.start_close(accepted.request_id, result)
        if accepted.spans is not None:  # the ledger's write, however long the database takes
            spans, started = accepted.spans, now_ns()
            closing.add_done_callback(lambda _f: spans.child("ledger write", started))
        self._metrics.finished(accepted.model, accepted.lane, result.status.value, queue_ms=result.queue_ms,
                               prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                               plan=accepted.plan)
        if result.error_code == JOB_LOST:
            self._metrics.lost(JOB_LOST)
        if accepted.keep_reply:
            with contextlib.suppress(RedisError):
                await self._replies.keep(accepted.request_id, self.idempotency_window_s)
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await asyncio.shield(closing)
        except TimeoutError:
            log.warning("the ledger row of %s closes when the database is back", accepted.request_id)
            closing.add_done_callback(lambda _f: self._later(self._settle_unit(accepted, result, closing)))
            return
        except Exception:  # noqa: BLE001 - bookkeeping must not break an answer already given
            log.exception("closing the ledger row of %s failed; its unit stays held", accepted.request_id)
            return
        await self._settle_unit(accepted, result, closing)

    async def _settle_unit(self, accepted: Accepted, result: Outcome, closed: asyncio.Future[None]) -> None:
        if closed.cancelled() or closed.exception() is not None:
            return  # the row is still open: the unit stays held
        if result.billable:
            self._held.release(accepted.request_id)
        else:
            await self.give_back(accepted)

    def _later(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abandon(self, accepted: Accepted, status: RequestStatus, http_status: int, code: str,
                      charged: bool) -> None:
        """End a request without its worker's terminal reply (cancelled, timed out, withdrawn)."""
        if accepted.owner:
            with contextlib.suppress(RedisError):
                await self._replies.cancel(accepted.request_id)
            # It ends without its worker's terminal reply, which is what takes a request out of its
            # in-flight sets otherwise.
            self._held.ended(accepted.request_id, accepted.account_id, accepted.key_id)
        await self.settle(accepted, Outcome(status, http_status, duration_ms=now_ms() - accepted.created_ms,
                                            error_code=code, billable=charged))

    async def recorded(self, accepted: Accepted, opening: asyncio.Future[None]) -> None:
        """Wait for the request's ledger row; without it the request is withdrawn, free."""
        try:
            await self._ledger.opened(opening)
        except DATABASE_DOWN:
            with contextlib.suppress(RedisError):
                await self._replies.cancel(accepted.request_id)
            self._held.ended(accepted.request_id, accepted.account_id, accepted.key_id)
            await self.give_back(accepted)
            raise ledger_unavailable() from None
