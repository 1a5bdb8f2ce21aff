"""What a finished request writes (flatfare.billing.ledger_rows), on each database: its ledger row, the
outbox row of a billable priced one on its meter, and the usage rollup, for a live request (opened, then
closed by the ledger) and for Batch API lines (recorded once finished, in the collector's transaction)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select, update

from flatfare.billing.ledger import Ledger
from flatfare.billing.ledger_rows import Charge, FinishedLine, Outcome, record_batch_lines
from flatfare.billing.plans import quota_window
from flatfare.contract import Usage
from flatfare.storage.models import Meter, Plan, PlatformUsageDaily, RequestRecord, RequestStatus, UsageDaily, UsageOutbox
from tests.billing.conftest import account_with_key

PRICE = 2000


async def _pro(sessions, discount: int) -> None:
    async with sessions() as session, session.begin():
        await session.execute(update(Plan).where(Plan.name == "pro").values(price_per_request_micros=PRICE,
                                                                            batch_discount_percent=discount))


async def _written(sessions) -> tuple[list[tuple], list[tuple], list[tuple], list[tuple]]:
    """(ledger rows, outbox rows, the account's rollup, the platform's rollup)."""
    async with sessions() as session:
        rows = (await session.execute(select(RequestRecord.id, RequestRecord.endpoint, RequestRecord.status,
                                             RequestRecord.billable, RequestRecord.price_micros,
                                             RequestRecord.prompt_tokens).order_by(RequestRecord.id))).all()
        outbox = (await session.execute(select(UsageOutbox.request_id, UsageOutbox.meter, UsageOutbox.status)
                                        .order_by(UsageOutbox.request_id))).all()
        daily = (await session.execute(select(UsageDaily.requests, UsageDaily.billable_requests,
                                              UsageDaily.price_micros))).all()
        platform = (await session.execute(select(PlatformUsageDaily.requests, PlatformUsageDaily.billable_requests,
                                                 PlatformUsageDaily.price_micros))).all()
    return [tuple(r) for r in rows], [tuple(r) for r in outbox], [tuple(r) for r in daily], [tuple(r) for r in platform]


async def test_batch_lines_are_billed_once_at_the_discount_on_the_batch_meter(sessions) -> None:
    await _pro(sessions, discount=25)
    issued = await account_with_key(sessions, "acme")
    lines = [FinishedLine("batch_a-0", issued.account_id, issued.key_id, "m", "chat", True, 200, Usage(5, 3)),
             FinishedLine("batch_a-1", issued.account_id, issued.key_id, "m", "chat", False, 500)]
    async with sessions() as session, session.begin():
        await record_batch_lines(session, lines)
    rows, outbox, daily, platform = await _written(sessions)
    assert rows == [("batch_a-0", "batch:chat", RequestStatus.SUCCEEDED.value, True, 1500, 5),
                    ("batch_a-1", "batch:chat", RequestStatus.FAILED.value, False, 0, 0)]
    assert outbox == [("batch_a-0", Meter.BATCH.value, "pending")]
    assert daily == platform == [(2, 1, 1500)]


async def test_a_live_request_s_close_owes_stripe_the_plan_s_price_on_the_requests_meter(sessions) -> None:
    await _pro(sessions, discount=25)
    issued = await account_with_key(sessions, "acme")
    ledger = Ledger(sessions)
    now = datetime.now(UTC)
    day = quota_window("UTC", now).day
    try:
        for request_id, billable in (("r-paid", True), ("r-free", False)):
            await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id,
                              model="m", endpoint="chat", stream=False, created_at=now,
                              charge=Charge("pro", PRICE, day))
            await ledger.close(request_id, Outcome(RequestStatus.SUCCEEDED if billable else RequestStatus.FAILED,
                                                   200 if billable else 500, prompt_tokens=7, billable=billable))
    finally:
        ledger.dispose()
    rows, outbox, daily, platform = await _written(sessions)
    assert rows == [("r-free", "chat", RequestStatus.FAILED.value, False, PRICE, 7),
                    ("r-paid", "chat", RequestStatus.SUCCEEDED.value, True, PRICE, 7)]
    assert outbox == [("r-paid", Meter.REQUESTS.value, "pending")]
    assert daily == platform == [(2, 1, PRICE)]
