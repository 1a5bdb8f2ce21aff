"""Exact daily request quotas in Redis, shared by every gateway process.

Check-and-count is part of the lane queue's one admission script (:mod:`flatfare.lanes.admit`, which the
gateway runs through ``LaneQueue.admit``): it reads the day's counter, refuses at the limit, otherwise
increments and sets the expiry, atomically with the job's queueing, so any number of gateways agree. A request that fails
before its first token gives its unit back. If Redis is unreachable the caller gets
:class:`QuotaUnavailable` (the gateway answers 503: fail closed, never per-process counters).

Counters are only trusted while the marker key ``contract.QUOTA_EPOCH_KEY`` exists. A Redis that lost its
data (restart without persistence, failover, flush) has no marker: the script then refuses to
count, and :meth:`DailyQuota.rebuild` recomputes the recent days' counters from the SQL ledger
before setting the marker again. The marker's value is the counters' generation: a new one each
rebuild.

Every counted unit is also *held* by the gateway process that counted it, in that process's hash
``contract.held_units(gateway_id)`` (request id -> "account:day:key"), until the request is settled:
a billable request releases it, a free one gives it back. The give-back script removes the held
entry and decrements in one step, so a unit is given back at most once, whoever does it: the
gateway itself, or the reaper (billing/held.py) for a gateway that died with units held.

Each API key has a counter of its own too (``contract.key_quota_counter_key``), counted by the same
admission script as its account's, and refused at the key's own daily cap.
A unit given back is given back to both counters in the one step, and a rebuild recomputes both.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta

import redis.asyncio as aioredis

# The keys are the contract's; this module's names for them are the ones its importers know.
from flatfare.contract import QUOTA_EPOCH_KEY as EPOCH_KEY
from flatfare.contract import QUOTA_REBUILD_LOCK_KEY as REBUILD_LOCK_KEY
from flatfare.contract import key_quota_counter_key as key_counter_key
from flatfare.contract import quota_counter_key as counter_key
from flatfare.redis_conn import REDIS_DOWN

# Counters outlive their day by this much, so a late give-back still finds them.
EXPIRY_SLACK_S = 3600

# KEYS: the day's counter, the holder's hash, the epoch marker, and the key's counter of the day
# when the unit counted one; ARGV: the request id, the generation it was counted in ('': only if
# still held). A unit no longer held was released or given back already, unless the counters were
# rebuilt since it was counted (the holder's hash went with the lost data, and the rebuild counted
# the request's open ledger row, for its account and its key).
_GIVE_BACK = """
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0
    and (ARGV[2] == '' or redis.call('GET', KEYS[3]) == ARGV[2]) then return -1 end
if KEYS[4] and tonumber(redis.call('GET', KEYS[4]) or '0') > 0 then redis.call('DECR', KEYS[4]) end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used > 0 then return redis.call('DECR', KEYS[1]) end
return 0
"""


class QuotaUnavailable(Exception):
    """Redis cannot be reached, so no request may be counted (and none is let through)."""


def expiry(resets_at: datetime) -> int:
    """When a day's counter may go (unix seconds)."""
    return int(resets_at.timestamp()) + EXPIRY_SLACK_S


# (account_id or key_id, day) -> billable requests, for the days to rebuild, leaving out the request
# ids given.
LedgerCounts = Callable[[list[str], tuple[str, ...]], Awaitable[dict[tuple[int, str], int]]]


def held_value(account_id: int, day: str, key_id: int | None) -> str:
    """What a held-units hash says of a unit: whose counters to give it back to."""
    return f"{account_id}:{day}" if key_id is None else f"{account_id}:{day}:{key_id}"


def parse_held(value: str) -> tuple[int, str, int | None]:
    """(account_id, day, key_id) of :func:`held_value`; key_id None for a unit that counted no key
    (held by a gateway that predates per-key counters)."""
    account_id, day, *key = value.split(":")
    return int(account_id), day, int(key[0]) if key else None


class DailyQuota:
    def __init__(self, redis: aioredis.Redis, ledger_counts: LedgerCounts,
                 key_ledger_counts: LedgerCounts | None = None) -> None:
        """``key_ledger_counts``: the per-key billable counts a rebuild restores the keys' counters
        from; without it a rebuild leaves every key's counter at zero."""
        self._redis = redis
        self._give_back = redis.register_script(_GIVE_BACK)
        self._ledger_counts = ledger_counts
        self._key_ledger_counts = key_ledger_counts

    async def give_back(self, account_id: int, day: str, request_id: str, holder: str, generation: str,
                        key_id: int | None = None) -> bool:
        """Give back the unit ``holder`` (a held-units hash) holds for the request, to its account's
        counter and, when it counted one, its key's; False if it was released or given back already.
        ``generation``: the counters' generation the unit was counted in, or '' to give it back only
        if it is still held."""
        keys = [counter_key(account_id, day), holder, EPOCH_KEY]
        if key_id is not None:
            keys.append(key_counter_key(key_id, day))
        try:
            left = await self._give_back(keys=keys, args=[request_id, generation])
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(str(exc)) from exc
        return left != -1

    async def used(self, account_id: int, day: str) -> int:
        try:
            value = await self._redis.get(counter_key(account_id, day))
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(str(exc)) from exc
        return int(value or 0)

    async def used_by_keys(self, key_ids: list[int], day: str) -> dict[int, int]:
        """Each key's count of ``day``."""
        if not key_ids:
            return {}
        try:
            values = await self._redis.mget([key_counter_key(key_id, day) for key_id in key_ids])
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(str(exc)) from exc
        return {key_id: int(value or 0) for key_id, value in zip(key_ids, values, strict=True)}

    async def used_by_accounts(self, days: dict[int, str]) -> dict[int, int]:
        """Each account's count of its day (account id -> quota day), a few thousand counters a round trip."""
        ids = list(days)
        used: dict[int, int] = {}
        try:
            for start in range(0, len(ids), 2000):
                chunk = ids[start:start + 2000]
                values = await self._redis.mget([counter_key(account_id, days[account_id]) for account_id in chunk])
                used.update((account_id, int(value or 0)) for account_id, value in zip(chunk, values, strict=True))
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(str(exc)) from exc
        return used

    async def rebuild(self, day: str, not_counted: tuple[str, ...] = ()) -> None:
        """Recompute counters for ``day`` and its neighbours from the ledger, then trust them again.
        ``not_counted``: requests whose rows are in the ledger but that are being admitted now (an
        idempotent request writes its row first): the admission counts them, the rebuild must not."""
        try:
            if await self._redis.exists(EPOCH_KEY):
                return
            if not await self._redis.set(REBUILD_LOCK_KEY, 1, nx=True, ex=30):
                await asyncio.sleep(0.05)  # another gateway is rebuilding
                return
            try:
                # Checked again under the lock: a rebuild that just finished must not be redone,
                # or it would wipe the units counted since.
                if await self._redis.exists(EPOCH_KEY):
                    return
                days = _neighbour_days(day)
                counts = await self._ledger_counts(days, not_counted)
                key_counts = await self._key_ledger_counts(days, not_counted) if self._key_ledger_counts else {}
                stale: list[bytes] = []
                for count_day in days:
                    for pattern in (counter_key("*", count_day), key_counter_key("*", count_day)):
                        stale += [key async for key in self._redis.scan_iter(match=pattern)]
                async with self._redis.pipeline(transaction=True) as pipe:
                    if stale:
                        pipe.delete(*stale)
                    for (account_id, count_day), count in counts.items():
                        pipe.set(counter_key(account_id, count_day), count, ex=3 * 86400)
                    for (key_id, count_day), count in key_counts.items():
                        pipe.set(key_counter_key(key_id, count_day), count, ex=3 * 86400)
                    pipe.set(EPOCH_KEY, uuid.uuid4().hex)  # a new generation
                    await pipe.execute()
            finally:
                await self._redis.delete(REBUILD_LOCK_KEY)
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(str(exc)) from exc


def _neighbour_days(day: str) -> list[str]:
    center = date.fromisoformat(day)
    return [(center + timedelta(days=offset)).isoformat() for offset in (-1, 0, 1)]
