"""Accounts and their keys: the operations the CLI (and later the admin API) share."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.db import one_session
from flatfare.storage.keys import ADMIN_PREFIX, hash_key, new_key, visible_prefix
from flatfare.storage.models import Account, AdminToken, ApiKey, Plan


class AccountError(Exception):
    """An account operation was refused; the message says why."""


@dataclass(frozen=True, slots=True)
class IssuedKey:
    account_id: int
    key_id: int
    secret: str


async def ensure_account(session: AsyncSession, name: str, plan: str | None = None) -> Account:
    """The account called ``name``, created on ``plan`` (default ``free``) if it does not exist."""
    plan_row = await session.get(Plan, plan or "free")
    if plan_row is None:
        known = ", ".join(sorted(await session.scalars(select(Plan.name))))
        raise AccountError(f"unknown plan {plan!r}; the plans are: {known}")
    account = await session.scalar(select(Account).where(Account.name == name))
    if account is None:
        account = Account(name=name, plan=plan_row.name, status="active")
        session.add(account)
    elif plan is not None and account.plan != plan:
        account.plan = plan
    else:
        return account
    # A trial runs from the moment the account is put on it.
    account.trial_ends_at = (datetime.now(UTC) + timedelta(days=plan_row.trial_days)) if plan_row.trial_days else None
    await session.flush()
    return account


async def issue_key(session: AsyncSession, account: Account, name: str = "") -> IssuedKey:
    """Create a key for ``account``; the secret is returned here and stored nowhere."""
    secret = new_key()
    key = ApiKey(account_id=account.id, name=name, prefix=visible_prefix(secret), key_hash=hash_key(secret))
    session.add(key)
    await session.flush()
    return IssuedKey(account_id=account.id, key_id=key.id, secret=secret)


async def create_key(database_url: str, account: str, plan: str | None = None, name: str = "") -> str:
    """Issue a key to the account called ``account`` (created on ``plan`` if it does not exist, see
    :func:`ensure_account`) in a session of its own, and commit; the secret."""
    async with one_session(database_url) as session:
        issued = await issue_key(session, await ensure_account(session, account, plan), name)
        await session.commit()
        return issued.secret


class AccountStore:
    """Account writes the gateway makes outside the request path."""

    def __init__(self, sessions) -> None:  # noqa: ANN001 - an async_sessionmaker
        self._sessions = sessions

    async def link_customer(self, account_id: int, customer_id: str) -> str:
        """Record the account's Stripe customer; the first one linked wins a race."""
        async with self._sessions() as session, session.begin():
            account = await session.get(Account, account_id, with_for_update=True)
            if account.stripe_customer_id is None:
                account.stripe_customer_id = customer_id
            return account.stripe_customer_id


async def issue_admin_token(session: AsyncSession, name: str, scopes: list[str],
                            created_by: int | None = None) -> tuple[AdminToken, str]:
    """Create an admin token; the secret is returned here and stored nowhere."""
    secret = new_key(ADMIN_PREFIX)
    token = AdminToken(name=name, prefix=visible_prefix(secret), token_hash=hash_key(secret),
                       scopes=sorted(set(scopes)), created_by=created_by)
    session.add(token)
    await session.flush()
    await session.refresh(token)
    return token, secret
