"""Billing tests' database: sessions on an empty, migrated database of each kind (tests/conftest.py's
``database_url``), and an account with a key to write ledger rows for."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.accounts import IssuedKey, ensure_account, issue_key
from flatfare.storage.db import create_engine, session_factory


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url, pool_size=2)
    yield session_factory(engine)
    await engine.dispose()


async def account_with_key(sessions: async_sessionmaker[AsyncSession], name: str, plan: str = "pro", *,
                           stripe_customer_id: str | None = None) -> IssuedKey:
    """A new account on ``plan`` (billed through Stripe as ``stripe_customer_id`` when given), with a key."""
    async with sessions() as session:
        account = await ensure_account(session, name, plan)
        account.stripe_customer_id = stripe_customer_id
        issued = await issue_key(session, account)
        await session.commit()
    return issued
