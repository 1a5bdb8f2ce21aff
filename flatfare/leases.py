"""One process at a time: a lease in Redis that its holder takes when free and renews while it is its own.

The billing outbox's sender, the batch dispatcher and the quota alerts' pass each run in one gateway
process at a time; a holder that dies lets its lease run out and another process takes it.
"""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

# Renew the lease only if it is still this holder's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Lease:
    """``key`` held for ``seconds`` at a time by this process (a fresh holder id per instance)."""

    def __init__(self, redis: aioredis.Redis, key: str, seconds: int) -> None:
        self._redis = redis
        self.key = key
        self.seconds = seconds
        self.holder = uuid.uuid4().hex
        self._renew = redis.register_script(_RENEW)

    async def renew(self) -> bool:
        """Extend the lease if this process still holds it; whether it does."""
        return bool(await self._renew(keys=[self.key], args=[self.holder, self.seconds]))

    async def hold(self) -> bool:
        """Take the lease if it is free, else renew it if it is ours; whether this process holds it now."""
        return bool(await self._redis.set(self.key, self.holder, nx=True, ex=self.seconds)) or await self.renew()
