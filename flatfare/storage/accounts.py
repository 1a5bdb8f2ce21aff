"""Accounts' keys and admin tokens: issued, found, changed, revoked, rotated, as the CLI, the admin API and
the console share them. (An account's plan changes through :mod:`flatfare.billing.plan_change` only.)"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.db import one_session
from flatfare.storage.keys import ADMIN_PREFIX, hash_key, looks_like_key, new_key, visible_prefix
from flatfare.storage.models import Account, AccountMember, AdminToken, ApiKey, ConsoleUser


class AccountError(Exception):
    """An account operation was refused; the message says why."""


UNSET: object = object()  # a field of an update that was not given


@dataclass(frozen=True, slots=True)
class IssuedKey:
    account_id: int
    key_id: int
    secret: str


@dataclass(frozen=True, slots=True)
class KeyLimitsUpdate:
    """Per-key limits to set; a field left UNSET keeps its value, None clears it (the plan or the
    account decides again)."""

    name: str | object = UNSET
    expires_at: datetime | None | object = UNSET
    allowed_models: list[str] | None | object = UNSET
    daily_limit: int | None | object = UNSET
    max_inflight: int | None | object = UNSET

    def apply(self, key: ApiKey) -> None:
        for field in ("name", "expires_at", "allowed_models", "daily_limit", "max_inflight"):
            value = getattr(self, field)
            if value is not UNSET:
                setattr(key, field, value)


async def issue_key(session: AsyncSession, account: Account, name: str = "",
                    limits: KeyLimitsUpdate | None = None, created_by_user_id: int | None = None) -> IssuedKey:
    """Create a key for ``account`` (with its own ``limits``, if any; made by console user
    ``created_by_user_id``, None for an operator); the secret is returned here and stored nowhere."""
    secret = new_key()
    key = ApiKey(account_id=account.id, name=name, prefix=visible_prefix(secret), key_hash=hash_key(secret),
                 created_by_user_id=created_by_user_id)
    if limits is not None:
        limits.apply(key)
    session.add(key)
    await session.flush()
    return IssuedKey(account_id=account.id, key_id=key.id, secret=secret)


def revoke(key: ApiKey | AdminToken, now: datetime | None = None) -> None:
    """Refused from now on (by every gateway process within its auth cache's lifetime); a key revoked
    already keeps its time."""
    if key.revoked_at is None:
        key.revoked_at = now or datetime.now(UTC)


async def rotate(session: AsyncSession, old: ApiKey, grace: timedelta, name: str | None = None) -> IssuedKey:
    """A new key for ``old``'s account, with its limits, its expiry (a rotation must not widen what
    the key may do, nor make it immortal) and its maker; ``old`` keeps working for ``grace``, never
    longer than it would have. The caller has locked ``old`` and checked it is not revoked."""
    original_expiry = old.expires_at
    ends = datetime.now(UTC) + grace
    if old.expires_at is None or ends < old.expires_at:
        old.expires_at = ends
    account = await session.get(Account, old.account_id)
    assert account is not None
    return await issue_key(session, account, old.name if name is None else name, KeyLimitsUpdate(
        allowed_models=old.allowed_models, daily_limit=old.daily_limit, max_inflight=old.max_inflight,
        expires_at=original_expiry), created_by_user_id=old.created_by_user_id)


async def find_key(session: AsyncSession, key: str) -> ApiKey:
    """The key named by its id, its visible prefix (``ff-`` and 8 characters) or its secret, locked for
    an update."""
    query = select(ApiKey).with_for_update()
    if key.isdigit():
        query = query.where(ApiKey.id == int(key))
    elif looks_like_key(key):
        query = query.where(ApiKey.key_hash == hash_key(key))
    else:
        query = query.where(ApiKey.prefix == key)
    rows = list(await session.scalars(query.limit(2)))
    if not rows:
        raise AccountError(f"no API key {key!r}; name it by its id, its prefix (ff- and 8 characters) or the key")
    if len(rows) > 1:
        raise AccountError(f"more than one key has the prefix {key!r}; name it by its id")
    return rows[0]


async def update_key(database_url: str, key: str, limits: KeyLimitsUpdate) -> ApiKey:
    """Change a key's name, expiry or limits (see :func:`find_key` for ``key``) and commit; the row."""
    async with one_session(database_url) as session:
        row = await find_key(session, key)
        limits.apply(row)
        await session.commit()
        await session.refresh(row)
        return row


async def active_keys(session: AsyncSession, account_id: int) -> list[ApiKey]:
    """The account's keys that are not revoked, oldest first."""
    return list(await session.scalars(select(ApiKey).where(ApiKey.account_id == account_id,
                                                           ApiKey.revoked_at.is_(None)).order_by(ApiKey.id)))


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


async def member_emails(session: AsyncSession, account_id: int, roles: list[str]) -> list[str]:
    """The addresses of the account's members in one of ``roles`` (whom a notice goes to)."""
    return list(await session.scalars(select(ConsoleUser.email).join(AccountMember,
                                                                     AccountMember.user_id == ConsoleUser.id)
                                      .where(AccountMember.account_id == account_id, AccountMember.role.in_(roles))))
