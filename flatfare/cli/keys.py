"""What ``flatfare keys create`` and ``flatfare up`` write: an API key for an account, which is created (on
its plan, by billing's one rule set) if it does not exist yet, in a session of its own."""

from __future__ import annotations

from flatfare.billing.plan_change import ensure_account
from flatfare.storage.accounts import KeyLimitsUpdate, issue_key
from flatfare.storage.db import one_session


async def create_key(database_url: str, account: str, plan: str | None = None, name: str = "",
                     limits: KeyLimitsUpdate | None = None) -> str:
    """Issue a key to the account called ``account`` (created on ``plan`` if it does not exist, see
    :func:`flatfare.billing.plan_change.ensure_account`) and commit; the secret."""
    async with one_session(database_url) as session:
        issued = await issue_key(session, await ensure_account(session, account, plan), name, limits)
        await session.commit()
        return issued.secret
