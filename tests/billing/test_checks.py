"""What /metrics reads of the ledger (billing/checks.py), against real SQL: each plan's quota used in its
day, and the checks that must stay at zero turning non-zero when the ledger and the meter disagree or a
row is left open."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, insert, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.checks import LedgerChecks, ledger_checks, quota_used
from flatfare.billing.ledger import Charge, Ledger, Outcome
from flatfare.billing.ledger_rows import outbox_row
from flatfare.storage.models import RequestRecord, RequestStatus, UsageOutbox
from tests.billing.conftest import account_with_key

DAY = "2026-12-03"


@pytest.fixture
async def ledger(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[Ledger]:
    writer = Ledger(sessions)
    yield writer
    writer.dispose()


async def _request(ledger: Ledger, issued, request_id: str, plan: str, price: int, *, endpoint: str = "chat",
                   outcome: Outcome | None = Outcome(RequestStatus.SUCCEEDED, 200), day: str = DAY,
                   created_at: datetime | None = None) -> None:
    await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint=endpoint, stream=False, created_at=created_at or datetime.now(UTC),
                      charge=Charge(plan=plan, price_micros=price, quota_day=day))
    if outcome is not None:
        await ledger.close(request_id, outcome)


async def _checks(sessions: async_sessionmaker[AsyncSession], open_before: datetime) -> LedgerChecks:
    async with sessions() as session:
        return await ledger_checks(session, datetime.now(UTC) - timedelta(days=1), open_before)


async def test_the_checks_stay_at_zero_until_the_ledger_and_the_meter_disagree(sessions, ledger) -> None:
    issued = await account_with_key(sessions, "acme")
    await _request(ledger, issued, "paid-1", "pro", 2000)
    await _request(ledger, issued, "paid-2", "pro", 2000)
    await _request(ledger, issued, "flat", "pro", 0)  # a flat plan: no meter event to send
    await _request(ledger, issued, "failed", "pro", 2000, outcome=Outcome(RequestStatus.FAILED, 500, billable=False))
    await _request(ledger, issued, "running", "pro", 2000, outcome=None)
    await _request(ledger, issued, "old", "pro", 2000, created_at=datetime.now(UTC) - timedelta(days=2))
    now = datetime.now(UTC)
    assert await _checks(sessions, now - timedelta(minutes=15)) == LedgerChecks(0, 0, 0)

    async with sessions() as session, session.begin():
        # A meter event lost, and one written for a row that is free; a row of two days ago is not read.
        await session.execute(delete(UsageOutbox).where(UsageOutbox.request_id.in_(["paid-2", "old"])))
        await session.execute(insert(UsageOutbox), [outbox_row("failed", issued.account_id, DAY, now, "chat")])
    assert await _checks(sessions, now - timedelta(minutes=15)) == LedgerChecks(1, 1, 0)
    # The row still running is stuck once it is older than the longest a request may take.
    assert (await _checks(sessions, datetime.now(UTC) + timedelta(seconds=1))).stuck_open == 1


async def test_quota_used_counts_each_plans_live_units_in_its_own_day(sessions, ledger) -> None:
    acme = await account_with_key(sessions, "acme")
    other = await account_with_key(sessions, "other")
    await _request(ledger, acme, "p1", "pro", 2000)
    await _request(ledger, other, "p2", "pro", 0)
    await _request(ledger, acme, "p3", "pro", 2000, outcome=None)  # running: its unit is counted
    await _request(ledger, acme, "p4", "pro", 2000, outcome=Outcome(RequestStatus.FAILED, 500, billable=False))
    await _request(ledger, acme, "p5", "pro", 2000, day="2026-12-02")  # yesterday's unit
    await _request(ledger, acme, "batch_1-0", "pro", 1000, endpoint="batch:chat")  # the batch allowance's
    await _request(ledger, other, "f1", "free", 0, day="2026-12-04")  # free's day is another (its timezone)
    async with sessions() as session:
        used = await quota_used(session, {"pro": DAY, "free": "2026-12-04", "premium": DAY},
                                datetime.now(UTC) - timedelta(hours=25))
        assert await quota_used(session, {}, datetime.now(UTC)) == {}
    assert used == {"pro": 3, "free": 1}
    async with sessions() as session, session.begin():
        await session.execute(update(RequestRecord).values(created_at=datetime.now(UTC) - timedelta(days=2)))
    async with sessions() as session:  # rows older than the window are not read
        assert await quota_used(session, {"pro": DAY}, datetime.now(UTC) - timedelta(hours=25)) == {}
