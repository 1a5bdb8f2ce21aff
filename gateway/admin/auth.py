"""Admin tokens (``ffa-...``) with scopes. API keys are refused here with 403, no credentials with 401."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from async_lru import alru_cache
from fastapi import Depends, Header, Request
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.audit import Actor
from flatfare.storage.keys import ADMIN_PREFIX, KEY_PREFIX, hash_key, hashes_match, looks_like_key
from flatfare.storage.models import AdminToken
from flatfare.gateway.auth import CACHE_SIZE, by_hash
from flatfare.gateway.errors import APIError
from flatfare.gateway.app_state import services_of


class Scope(StrEnum):
    READ = "admin:read"
    WRITE = "admin:write"


@dataclass(frozen=True, slots=True)
class Admin:
    # None: a console user with ``is_admin`` (no token), named in the audit log by ``name`` only.
    token_id: int | None
    name: str
    scopes: frozenset[str]

    @property
    def actor(self) -> Actor:
        """How the audit log names this admin."""
        return Actor(self.token_id, self.name)


class AdminAuthenticator:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self._sessions = sessions
        # Bounded: refusals are cached too, and anyone can send made-up tokens.
        self._lookup = alru_cache(maxsize=CACHE_SIZE, ttl=ttl_s, key=by_hash)(self._read)

    async def authenticate(self, authorization: str | None) -> Admin:
        if not authorization:
            raise APIError(401, "Admin routes need 'Authorization: Bearer ffa-...'.", code="missing_admin_token")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token.startswith(KEY_PREFIX):
            raise APIError(403, "API keys cannot use the admin API; use an admin token.", code="api_key_not_allowed")
        if scheme.lower() != "bearer" or not looks_like_key(token, ADMIN_PREFIX):
            raise APIError(401, "Invalid admin token.", code="invalid_admin_token")
        admin = await self._lookup(token, hash_key(token))
        if admin is None:
            raise APIError(401, "Invalid or revoked admin token.", code="invalid_admin_token")
        return admin

    async def _read(self, token: str, token_hash: str) -> Admin | None:
        async with self._sessions() as session:
            row = await session.scalar(select(AdminToken).where(AdminToken.token_hash == token_hash))
        if row is None or row.revoked_at is not None or not hashes_match(row.token_hash, token):
            return None
        return Admin(token_id=row.id, name=row.name, scopes=frozenset(row.scopes))


async def _admin(request: Request, authorization: Annotated[str | None, Header()] = None) -> Admin:
    return await services_of(request).admin_auth.authenticate(authorization)


async def _reader(admin: Annotated[Admin, Depends(_admin)]) -> Admin:
    if Scope.READ.value not in admin.scopes:
        raise APIError(403, f"This admin token lacks the '{Scope.READ.value}' scope.", code="insufficient_scope")
    return admin


AdminReader = Annotated[Admin, Depends(_reader)]
# A route that writes: the admin is authenticated here; the write scope is checked by the admin services'
# audited write (flatfare.gateway.admin.services.writing), the one way every admin write is made.
AdminWriter = Annotated[Admin, Depends(_admin)]
