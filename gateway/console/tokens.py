"""One-time emailed tokens (password reset, email confirmation), kept in Redis under their SHA-256
with the user id as value; taking one deletes it (GETDEL), so a link works once."""

from __future__ import annotations

import hashlib
import secrets

from redis.asyncio import Redis

from flatfare.gateway.console.keyspace import console_token_key

RESET = "reset"
VERIFY = "verify"
_TOKEN_LENGTH = 43


def _key(purpose: str, token: str) -> str:
    return console_token_key(purpose, hashlib.sha256(token.encode()).hexdigest())


async def issue(redis: Redis, purpose: str, user_id: int, ttl_s: int) -> str:
    token = secrets.token_urlsafe(32)
    await redis.set(_key(purpose, token), str(user_id), ex=ttl_s)
    return token


async def peek(redis: Redis, purpose: str, token: str) -> int | None:
    if len(token) != _TOKEN_LENGTH:
        return None
    value = await redis.get(_key(purpose, token))
    return int(value) if value else None


async def take(redis: Redis, purpose: str, token: str) -> int | None:
    if len(token) != _TOKEN_LENGTH:
        return None
    value = await redis.getdel(_key(purpose, token))
    return int(value) if value else None
