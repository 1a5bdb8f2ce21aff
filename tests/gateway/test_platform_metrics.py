"""What a scrape reads of the ledger is read at most every FLATFARE_METRICS_LEDGER_EVERY_S per process."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.ledger import Charge, Ledger
from flatfare.billing.plans import quota_window
from flatfare.gateway.platform_metrics import LedgerWatch
from flatfare.gateway.settings import GatewaySettings
from tests.billing.conftest import account_with_key


async def test_the_ledger_is_read_again_only_once_its_reading_is_old(
        sessions: async_sessionmaker[AsyncSession]) -> None:
    settings = GatewaySettings(redis_url="redis://unused")
    now = [0.0]
    watch = LedgerWatch(30.0, clock=lambda: now[0])
    issued = await account_with_key(sessions, "acme", "premium")
    ledger = Ledger(sessions)

    async def used() -> int:
        async with sessions() as session:
            plans, checks = await watch.read(session, settings, datetime.now(UTC))
        assert checks.stuck_open == 0 and plans["premium"].ttft_target_s == settings.plan_ttft_target_s["premium"]
        return plans["premium"].quota_used

    try:
        assert await used() == 0
        await ledger.open(request_id="r1", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                          endpoint="chat", stream=False, created_at=datetime.now(UTC),
                          charge=Charge("premium", 0, quota_window("UTC", datetime.now(UTC)).day))
        now[0] = 29.0
        assert await used() == 0  # the last reading, 29 s old
        now[0] = 30.0
        assert await used() == 1
    finally:
        ledger.dispose()
