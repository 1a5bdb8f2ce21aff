"""Accounts and their keys: the operations the CLI (and later the admin API) share."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.keys import hash_key, new_key, visible_prefix
from flatfare.storage.models import Account, ApiKey, Plan


class AccountError(Exception):
    """An account operation was refused; the message says why."""


@dataclass(frozen=True, slots=True)
class IssuedKey:
    account_id: int
    key_id: int
    secret: str


async def ensure_account(session: AsyncSession, name: str, plan: str | None = None) -> Account:
    """The account called ``name``, created on ``plan`` (default ``free``) if it does not exist."""
    if plan is not None and await session.get(Plan, plan) is None:
        known = ", ".join(sorted(await session.scalars(select(Plan.name))))
        raise AccountError(f"unknown plan {plan!r}; the plans are: {known}")
    account = await session.scalar(select(Account).where(Account.name == name))
    if account is None:
        account = Account(name=name, plan=plan or "free", status="active")
        session.add(account)
        await session.flush()
    elif plan is not None and account.plan != plan:
        account.plan = plan
    return account


async def issue_key(session: AsyncSession, account: Account, name: str = "") -> IssuedKey:
    """Create a key for ``account``; the secret is returned here and stored nowhere."""
    secret = new_key()
    key = ApiKey(account_id=account.id, name=name, prefix=visible_prefix(secret), key_hash=hash_key(secret))
    session.add(key)
    await session.flush()
    return IssuedKey(account_id=account.id, key_id=key.id, secret=secret)
