"""What the gateway's ``/metrics`` reads of the ledger's recent rows: each plan's daily quota used, whether
the ledger and the meter (the usage outbox Stripe is sent from) agree, and whether any row was left open
past the longest a request may take. Read only; ``flatfare billing reconcile`` repairs.

Each check reads only the rows created since ``since`` (``requests.created_at`` is indexed), so its
cost stays bounded by a day's traffic, not by the ledger's history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, exists, func, not_, select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.billing.ledger_rows import BATCH_ENDPOINT_PREFIX
from flatfare.storage.models import RequestRecord, RequestStatus, UsageOutbox


@dataclass(frozen=True, slots=True)
class LedgerChecks:
    # Closed, billable, priced rows with no meter event: usage that would never be billed.
    unmetered: int
    # Meter events whose row is not billable or not priced: usage that would be billed wrongly.
    overmetered: int
    # Rows still open (queued) though created before the cutoff: requests nobody will settle.
    stuck_open: int


def _charged() -> object:
    return and_(RequestRecord.billable.is_(True), RequestRecord.price_micros > 0)


async def ledger_checks(session: AsyncSession, since: datetime, open_before: datetime) -> LedgerChecks:
    """The three counts over the rows created since ``since``; a row open is stuck once it was created
    before ``open_before``."""
    recent = RequestRecord.created_at >= since
    metered = exists().where(UsageOutbox.request_id == RequestRecord.id)
    unmetered = await session.scalar(select(func.count()).select_from(RequestRecord).where(
        recent, RequestRecord.status != RequestStatus.QUEUED.value, _charged(), not_(metered)))
    overmetered = await session.scalar(select(func.count()).select_from(UsageOutbox).join(
        RequestRecord, RequestRecord.id == UsageOutbox.request_id).where(recent, not_(_charged())))
    stuck = await session.scalar(select(func.count()).select_from(RequestRecord).where(
        recent, RequestRecord.created_at < open_before, RequestRecord.status == RequestStatus.QUEUED.value))
    return LedgerChecks(int(unmetered or 0), int(overmetered or 0), int(stuck or 0))


async def quota_used(session: AsyncSession, days: dict[str, str], since: datetime) -> dict[str, int]:
    """Each plan's daily quota units in use in its current quota day (``days``: plan -> that day): the
    billable rows of live requests charged on the plan, open ones included (their unit is counted;
    Batch API lines have an allowance of their own). Rows created before ``since`` are not read: pass
    a time before the longest quota day began."""
    if not days:
        return {}
    rows = await session.execute(select(RequestRecord.plan, RequestRecord.quota_day, func.count()).where(
        RequestRecord.created_at >= since, RequestRecord.billable.is_(True),
        RequestRecord.quota_day.in_(set(days.values())),
        not_(RequestRecord.endpoint.startswith(BATCH_ENDPOINT_PREFIX)))
        .group_by(RequestRecord.plan, RequestRecord.quota_day))
    return {plan: int(count) for plan, day, count in rows.all() if plan in days and days[plan] == day}
