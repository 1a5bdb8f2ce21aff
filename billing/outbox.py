"""Delivering the meter-event outbox to Stripe, and reconciling it with the ledger.

Rows are written by :meth:`flatfare.billing.ledger.Ledger.close` in the transaction that makes a request
billable, so none is lost. Each is sent with ``identifier`` = the request id, which Stripe
de-duplicates, so a row sent twice (a crash between sending and marking) is still billed once.
Failures back off exponentially; a row never disappears until it is sent (or skipped because the
account has no Stripe customer, i.e. is not billed through Stripe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis
from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.stripe_client import BillingError, StripeGateway
from flatfare.contract import OUTBOX_LEADER_KEY as LEADER_KEY
from flatfare.leases import Lease
from flatfare.tracing import Tracer
from flatfare.billing.ledger_rows import outbox_row
from flatfare.storage.models import Account, Meter, OutboxStatus, RequestRecord, UsageOutbox

log = logging.getLogger("flatfare.billing")

BATCH = 100
# Meter-event calls in flight at once (FLATFARE_BILLING_OUTBOX_CONCURRENCY), and the rows marked in one
# transaction after them. One call at a time, a sender is bound by Stripe's round trip (~7 events a second at
# 0.15 s), and here, with a commit a row, kept up with ~90 requests a second beside the soak's traffic.
CONCURRENCY = 8
MAX_BACKOFF_S = 3600


def backoff(attempts: int, most_s: float = MAX_BACKOFF_S) -> timedelta:
    return timedelta(seconds=min(2 ** max(attempts - 1, 0), most_s))


class OutboxSender:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], stripe: StripeGateway,
                 max_backoff_s: float = MAX_BACKOFF_S, tracer: Tracer | None = None,
                 concurrency: int = CONCURRENCY) -> None:
        self._sessions = sessions
        self._stripe = stripe
        self._max_backoff_s = max_backoff_s
        self._concurrency = concurrency
        # Each send is a span (flatfare.tracing; None: off) in a trace of its own, sampled like a request
        # without a traceparent: the row does not keep its request's trace. flatfare.request_id joins them.
        self._tracer = tracer

    async def send_due(self, now: datetime | None = None,
                       holding: Callable[[], Awaitable[bool]] | None = None) -> int:
        """Send every row that is due, ``concurrency`` calls at a time; returns how many were sent.
        ``holding``, asked before each group, ends the pass early when it answers False (the sender's lease
        was lost). A group's rows are marked together once its calls have ended: a crash in between sends
        them again, which Stripe de-duplicates by identifier."""
        now = now or datetime.now(UTC)
        async with self._sessions() as session:
            rows = (await session.execute(
                select(UsageOutbox, Account.stripe_customer_id)
                .join(Account, Account.id == UsageOutbox.account_id)
                .where(UsageOutbox.status == OutboxStatus.PENDING.value, UsageOutbox.next_attempt_at <= now)
                .order_by(UsageOutbox.next_attempt_at).limit(BATCH))).all()
        sent = 0
        for start in range(0, len(rows), self._concurrency):
            if holding is not None and not await holding():
                break
            group = rows[start:start + self._concurrency]
            outcomes = await asyncio.gather(*(self._traced(row, customer_id, now) for row, customer_id in group))
            async with self._sessions() as session:
                for (row, _), values in zip(group, outcomes, strict=True):
                    await session.execute(update(UsageOutbox).where(
                        UsageOutbox.request_id == row.request_id, UsageOutbox.status == OutboxStatus.PENDING.value)
                        .values(**values))
                await session.commit()
            sent += sum(values.get("status") == OutboxStatus.SENT.value for values in outcomes)
        return sent

    async def _traced(self, row: UsageOutbox, customer_id: str | None, now: datetime) -> dict[str, object]:
        if self._tracer is None:
            return await self._attempt(row, customer_id, now)
        _, spans = self._tracer.start("outbox send", None, kind="client", **{
            "flatfare.request_id": row.request_id, "flatfare.meter": row.meter, "flatfare.attempt": row.attempts + 1})
        values: dict[str, object] = {}
        try:
            values = await self._attempt(row, customer_id, now)
        finally:
            if spans is not None:
                spans.finish(**{"flatfare.sent": values.get("status") == OutboxStatus.SENT.value})
        return values

    async def _attempt(self, row: UsageOutbox, customer_id: str | None, now: datetime) -> dict[str, object]:
        """One try at a row's meter event: what to write to the row."""
        if customer_id is None:
            return {"status": OutboxStatus.SKIPPED.value, "last_error": "account has no Stripe customer"}
        try:
            await self._stripe.send_meter_event(customer_id=customer_id, identifier=row.request_id,
                                                timestamp=int(row.created_at.timestamp()),
                                                batch=row.meter == Meter.BATCH.value)
        except BillingError as exc:
            attempts = row.attempts + 1
            log.warning("meter event for %s failed (attempt %d): %s", row.request_id, attempts, exc)
            return {"attempts": attempts, "next_attempt_at": now + backoff(attempts, self._max_backoff_s),
                    "last_error": str(exc)[:500]}
        return {"status": OutboxStatus.SENT.value, "sent_at": now, "attempts": row.attempts + 1}

    async def run(self, redis: aioredis.Redis, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Send due rows every ``interval_s``, in one process at a time (a lease in Redis)."""
        # The lease outlives the slowest meter-event call twice over: renewed before each call, it
        # cannot lapse while one is in flight (20 s Stripe timeout: a 40 s lease, so a dead sender's
        # successor waits that long; billing is not in a hurry, a second sender would be wrong).
        # Renewed before each group of calls too: a pass longer than the lease must not let a second
        # process take it and send the same rows meanwhile.
        lease = Lease(redis, LEADER_KEY, max(int(interval_s * 10), 5, math.ceil(2 * self._stripe.config.timeout_s)))
        while not stop.is_set():
            try:
                if await lease.hold():
                    await self.send_due(holding=lease.renew)
            except Exception:  # noqa: BLE001 - the loop must outlive a database or Redis hiccup
                log.exception("outbox pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


@dataclass(frozen=True, slots=True)
class Reconciliation:
    day: str
    billable: int
    in_outbox: int
    sent: int
    repaired: int


async def reconcile(sessions: async_sessionmaker[AsyncSession], day: str) -> Reconciliation:
    """Compare the day's priced, billable ledger rows with the outbox and add the missing rows."""
    now = datetime.now(UTC)
    async with sessions() as session, session.begin():
        billable = select(RequestRecord.id, RequestRecord.account_id, RequestRecord.endpoint).where(
            RequestRecord.quota_day == day, RequestRecord.billable.is_(True), RequestRecord.price_micros > 0,
            RequestRecord.status != "queued")
        missing = (await session.execute(
            billable.where(~RequestRecord.id.in_(select(UsageOutbox.request_id))))).all()
        if missing:
            await session.execute(insert(UsageOutbox), [outbox_row(request_id, account_id, day, now, endpoint)
                                                        for request_id, account_id, endpoint in missing])
        total = await session.scalar(select(func.count()).select_from(billable.subquery()))
        in_outbox = await session.scalar(select(func.count()).where(UsageOutbox.day == day))
        sent = await session.scalar(select(func.count()).where(
            UsageOutbox.day == day, UsageOutbox.status == OutboxStatus.SENT.value))
    return Reconciliation(day=day, billable=total or 0, in_outbox=in_outbox or 0, sent=sent or 0,
                          repaired=len(missing))
