"""Failed console attempts counted in Redis per window: per client address, and per account *from* an
address (the email and the address together). Past the limit, further attempts are refused (429) until
the window ends, whatever the password. Keying the account's counter by address too means a stranger
guessing at someone's email locks only themselves out: the owner, from their own address, still logs in
(and is told by email that their login was locked from another address: :mod:`.lockout`)."""

from __future__ import annotations

import hashlib

from redis.asyncio import Redis

from flatfare.gateway.console.keyspace import console_attempts_key


def email_subject(email: str, address: str) -> tuple[str, str]:
    """The counter of an account's failures from one client address, named by a hash of both (no email
    or address in Redis key names)."""
    return "account", hashlib.sha256(f"{email.lower()}\n{address}".encode()).hexdigest()


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

    async def failed(self, *subjects: tuple[str, str]) -> list[bool]:
        """Count a failure for each subject; for each, whether this failure is the one that locked it."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, subject in subjects:
                key = console_attempts_key(kind, subject)
                pipe.incr(key)
                pipe.expire(key, self.window_s, nx=True)
            counts = (await pipe.execute())[::2]
        return [int(count) == self._attempts for count in counts]

    async def clear(self, *subjects: tuple[str, str]) -> None:
        await self._redis.delete(*(console_attempts_key(kind, s) for kind, s in subjects))
