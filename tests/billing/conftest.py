"""Billing tests: an account with a key to write ledger rows for (`sessions` is tests/conftest.py's)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.accounts import IssuedKey, issue_key
from flatfare.billing.plan_change import ensure_account


async def account_with_key(sessions: async_sessionmaker[AsyncSession], name: str, plan: str = "pro", *,
                           stripe_customer_id: str | None = None) -> IssuedKey:
    """A new account on ``plan`` (billed through Stripe as ``stripe_customer_id`` when given), with a key."""
    async with sessions() as session:
        account = await ensure_account(session, name, plan)
        account.stripe_customer_id = stripe_customer_id
        issued = await issue_key(session, account)
        await session.commit()
    return issued
