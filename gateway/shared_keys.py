"""Shared-key detection: a flat plan's typical abuse is one key passed around many people, each
request the same flat price. Per API key and UTC day, the distinct client addresses and user agents
it was used from are counted, as keyed hashes (HMAC-SHA256 with a server secret) in Redis
HyperLogLogs kept ``shared_keys_keep_days``: never the addresses themselves, about 12 KiB a key at
most, a fixed cost whatever the traffic.

The request path only records: the admission script (flatfare.lanes.admit) adds the request's
:class:`~flatfare.lanes.admit.KeySighting` with the rest of its counting, in the same round trip, and
lists the key in the day's set once it passes its plan's alert threshold; with the plan's
``shared_key_max_addresses``, it refuses a request from yet another address while the key was used
from that many in the last ``shared_keys_window_s`` (429 ``key_shared_too_widely``, nothing counted).
The owner's email is sent by a background pass (:mod:`flatfare.gateway.console.shared_key_notice`);
the console and the admin console read the counts here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import UTC, datetime, timedelta

from redis.asyncio import Redis

from flatfare import contract
from flatfare.billing.plans import PlanRules
from flatfare.lanes.admit import KeySighting
from flatfare.redis_conn import REDIS_DOWN

log = logging.getLogger("flatfare.gateway")

# A user agent longer than this is counted by its first this many characters.
MAX_AGENT_CHARS = 512


def sighting_day(now: datetime) -> str:
    """The UTC day a sighting counts on (every plan's, whatever its quota timezone)."""
    return now.astimezone(UTC).strftime("%Y-%m-%d")


class SharedKeys:
    """The keyed hashes the admission script records, and the counts read back."""

    def __init__(self, redis: Redis, keep_days: int = 7, window_s: int = 600, secret: str = "") -> None:
        self._redis = redis
        self.keep_days = keep_days
        self.window_s = window_s
        self._secret = secret.encode()

    async def start(self) -> None:
        """Without a configured secret, the deployment's random one, made once and kept in Redis (every
        gateway process hashes alike)."""
        if self._secret:
            return
        await self._redis.set(contract.KEY_SIGHTINGS_SECRET_KEY, secrets.token_hex(32), nx=True)
        stored = await self._redis.get(contract.KEY_SIGHTINGS_SECRET_KEY)
        self._secret = stored if isinstance(stored, bytes) else str(stored).encode()

    async def start_if_reachable(self) -> None:
        """:meth:`start`, unless Redis is away (then nothing is recorded until the notice pass, which
        calls :meth:`start` each time, reaches it)."""
        try:
            await self.start()
        except REDIS_DOWN as exc:
            log.warning("shared-key detection waits for Redis: %s", exc)

    def _hash(self, kind: bytes, value: str) -> str:
        return hmac.new(self._secret, kind + value.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:24]

    def sighting(self, address: str | None, agent: str, plan: PlanRules, now: datetime) -> KeySighting | None:
        """What to record of a request from ``address`` with user agent ``agent`` (None: no address known,
        or no secret yet: nothing recorded)."""
        if not address or not self._secret:
            return None
        return KeySighting(self._hash(b"a:", address), self._hash(b"u:", agent[:MAX_AGENT_CHARS]),
                           sighting_day(now), self.keep_days * 86_400, plan.shared_key_alert_addresses,
                           plan.shared_key_max_addresses, self.window_s * 1000)

    async def counts(self, key_ids: list[int], day: str) -> dict[int, tuple[int, int]]:
        """Each key's distinct addresses and user agents on ``day`` (HyperLogLog estimates: within about
        1 %, exact for small counts)."""
        if not key_ids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for key_id in key_ids:
                pipe.pfcount(contract.key_addresses_key(key_id, day))
                pipe.pfcount(contract.key_agents_key(key_id, day))
            answers = await pipe.execute()
        return {key_id: (int(answers[2 * i]), int(answers[2 * i + 1])) for i, key_id in enumerate(key_ids)}

    async def shared(self, day: str) -> set[int]:
        """The keys listed as shared on ``day``: used from more addresses than their plan's threshold."""
        return {int(member) for member in await self._redis.smembers(contract.shared_keys_key(day))}

    async def listed(self, key_ids: list[int], day: str) -> set[int]:
        """Which of ``key_ids`` are listed as shared on ``day``."""
        if not key_ids:
            return set()
        member = await self._redis.smismember(contract.shared_keys_key(day), key_ids)
        return {key_id for key_id, yes in zip(key_ids, member, strict=True) if yes}

    async def first_to_tell(self, key_id: int, day: str) -> bool:
        """True for the one gateway process that is to tell the key's owner about ``day`` (SET NX)."""
        return bool(await self._redis.set(contract.shared_key_told_key(key_id, day), "1", nx=True,
                                          ex=self.keep_days * 86_400))


def recent_days(now: datetime) -> list[str]:
    """Today and yesterday (UTC): a key listed just before midnight is still told after it."""
    return [sighting_day(now), sighting_day(now - timedelta(days=1))]
