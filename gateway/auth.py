"""API-key authentication: ``Authorization: Bearer ff-...`` -> the calling account."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from async_lru import alru_cache
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.keys import hash_key, hashes_match, looks_like_key
from flatfare.storage.models import Account, AccountStatus, ApiKey
from flatfare.gateway.errors import APIError

_LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What the API key itself allows, within its account's plan: None leaves it to the plan."""

    name: str
    prefix: str
    allowed_models: tuple[str, ...] | None = None
    daily_limit: int | None = None
    # Requests of this key in flight at once; the account's cap binds too, so the lower one wins.
    max_inflight: int | None = None

    @property
    def label(self) -> str:
        """How error messages name the key: its name and visible prefix (never the secret)."""
        return f"'{self.name}' ({self.prefix}...)" if self.name else f"{self.prefix}..."

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass(frozen=True, slots=True)
class Caller:
    account_id: int
    account_name: str
    key_id: int
    # A detached copy of the account row: plan, trial end, limits, dedicated pool, Stripe ids.
    account: Account
    key: KeyLimits = KeyLimits("", "")


def caller_of(account: Account, key: ApiKey) -> Caller:
    """The caller a key of ``account`` makes (``account`` detached from its session)."""
    models = key.allowed_models
    limits = KeyLimits(key.name, key.prefix, None if models is None else tuple(models), key.daily_limit,
                       key.max_inflight)
    return Caller(account_id=account.id, account_name=account.name, key_id=key.id, account=account, key=limits)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


# Distinct keys (or refusals) remembered at once; the least recently used go first.
CACHE_SIZE = 100_000


def by_hash(_key: str, key_hash: str) -> str:
    return key_hash  # the cache holds hashes, never keys


class Authenticator:
    """Looks keys up by hash, caching each answer for ``ttl_s`` so a revocation lands within it.

    Concurrent requests with one key share one lookup (async-lru), so an expiring entry costs one
    query, not one per request in flight."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self._sessions = sessions
        self._lookup = alru_cache(maxsize=CACHE_SIZE, ttl=ttl_s, key=by_hash)(self._read)

    async def authenticate(self, authorization: str | None) -> Caller:
        if not authorization:
            raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer ff-...'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not looks_like_key(key):
            raise _unauthorized("Incorrect API key provided. Flatfare keys look like 'ff-' and 43 more characters.")
        outcome = await self._lookup(key, hash_key(key))
        if isinstance(outcome, APIError):
            raise outcome
        return outcome

    async def _read(self, key: str, key_hash: str) -> Caller | APIError:
        async with self._sessions() as session:
            row = (await session.execute(
                select(ApiKey, Account).join(Account, Account.id == ApiKey.account_id)
                .where(ApiKey.key_hash == key_hash)
            )).first()
            if row is None or not hashes_match(row.ApiKey.key_hash, key):
                return _unauthorized("Incorrect API key provided.")
            api_key, account = row.ApiKey, row.Account
            if api_key.revoked_at is not None:
                return _unauthorized("This API key has been revoked.")
            now = datetime.now(UTC)
            if api_key.expires_at is not None and now >= api_key.expires_at:
                return _unauthorized(f"This API key expired at {api_key.expires_at.isoformat(timespec='seconds')}"
                                     "; use a current key (a rotated key expires when its grace period ends).")
            if account.status != AccountStatus.ACTIVE:
                return APIError(403, f"The account '{account.name}' is {account.status.replace('_', ' ')}; "
                                "contact the platform's administrators.", code="account_inactive")
            last = api_key.last_used_at
            if last is None or now - last > _LAST_USED_RESOLUTION:
                await session.execute(update(ApiKey).where(ApiKey.id == api_key.id).values(last_used_at=now))
                await session.commit()
            session.expunge(account)
            return caller_of(account, api_key)
