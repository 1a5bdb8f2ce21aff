"""The plans as the gateway sees them: read from SQL, reused for a moment, so an edit lands everywhere fast."""

from __future__ import annotations

import time
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.plans import AccountTerms, PlanRules, account_terms
from flatfare.storage.models import Account, Plan


class PlanBook:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self._sessions = sessions
        self._ttl_s = ttl_s
        self._plans: tuple[float, dict[str, PlanRules]] = (0.0, {})

    async def plans(self) -> dict[str, PlanRules]:
        expires, plans = self._plans
        if expires > time.monotonic():
            return plans
        async with self._sessions() as session:
            plans = {row.name: PlanRules.from_row(row) for row in await session.scalars(select(Plan))}
        self._plans = (time.monotonic() + self._ttl_s, plans)
        return plans

    async def terms(self, account: Account, now: datetime) -> AccountTerms:
        return account_terms(account, await self.plans(), now)
