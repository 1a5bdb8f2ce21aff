"""Failed console attempts counted in Redis per window, per account and per client address: past the
limit, further attempts are refused (429) until the window ends, whatever the password."""

from __future__ import annotations

import hashlib

from redis.asyncio import Redis

from flatfare.contract import console_attempts_key


def email_subject(email: str) -> tuple[str, str]:
    """The account's counter, named by a hash of its email (no address in Redis key names)."""
    return "account", hashlib.sha256(email.lower().encode()).hexdigest()


def address_subject(address: str) -> tuple[str, str]:
    return "address", address


class AttemptLimiter:
    def __init__(self, redis: Redis, attempts: int, window_s: int) -> None:
        self._redis = redis
        self._attempts = attempts
        self.window_s = window_s

    async def blocked(self, *subjects: tuple[str, str]) -> bool:
        counts = await self._redis.mget([console_attempts_key(kind, s) for kind, s in subjects])
        return any(c is not None and int(c) >= self._attempts for c in counts)

    async def failed(self, *subjects: tuple[str, str]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, subject in subjects:
                key = console_attempts_key(kind, subject)
                pipe.incr(key)
                pipe.expire(key, self.window_s, nx=True)
            await pipe.execute()

    async def clear(self, *subjects: tuple[str, str]) -> None:
        await self._redis.delete(*(console_attempts_key(kind, s) for kind, s in subjects))
