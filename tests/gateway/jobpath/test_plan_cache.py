"""The gateway's plan book: plans are reused for a moment, yet an account on a plan created within that
moment is served, not answered 500."""

from __future__ import annotations

from datetime import UTC, datetime

from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import Account, Plan


async def test_an_account_on_a_plan_created_since_the_last_read_gets_its_terms(database_url: str) -> None:
    engine = create_engine(database_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        book = PlanBook(sessions, ttl_s=3600)
        assert "gold" not in await book.plans()  # read and cached for an hour
        async with sessions() as session:
            session.add(Plan(name="gold", display_name="Gold", daily_limit=42, price_per_request_micros=0,
                             monthly_price_cents=0, lane="premium", max_n=2, max_body_bytes=1 << 20,
                             timezone="UTC"))
            await session.flush()
            account = Account(name="new-customer", plan="gold")
            session.add(account)
            await session.commit()
        terms = await book.terms(account, datetime.now(UTC))
        assert (terms.plan.name, terms.daily_limit) == ("gold", 42)
    finally:
        await engine.dispose()
