"""The plans as the gateway sees them: read from SQL, reused for a moment, so an edit lands everywhere fast."""

from __future__ import annotations

from datetime import datetime

from async_lru import alru_cache
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.plans import AccountTerms, PlanRules, account_terms
from flatfare.storage.models import Account, Plan


class PlanBook:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self._sessions = sessions
        # One read per ``ttl_s``, shared by every request in flight when it expires.
        self.plans = alru_cache(maxsize=1, ttl=ttl_s)(self._read)

    async def _read(self) -> dict[str, PlanRules]:
        async with self._sessions() as session:
            return {row.name: PlanRules.from_row(row) for row in await session.scalars(select(Plan))}

    async def terms(self, account: Account, now: datetime) -> AccountTerms:
        plans = await self.plans()
        if account.plan not in plans:  # a plan created since the last read (the account is newer)
            self.plans.cache_clear()
            plans = await self.plans()
        return account_terms(account, plans, now)
