"""Putting jobs on a lane, with backpressure: a full lane answers at once instead of queueing without
bound, and its Retry-After comes from how fast the lane has been draining. A lane's maximum wait
becomes a depth bound at its recent drain rate, so both bounds are one atomic check-and-add.

Admission is one round trip: :meth:`LaneQueue.admit` runs one script that checks and counts the
account's daily quota and the API key's (flatfare.billing.quota's Lua, unchanged), checks the
account's and the key's requests in flight against their caps, checks the lane's depth and adds the
job to its account's queue on the lane (the claim script, workers/claims.py, serves a lane's accounts
in turn). A refusal of any kind leaves nothing behind: no unit counted, nothing in flight, no job."""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from flatfare.billing.quota import (EPOCH_KEY, KEY_QUOTA_CHECK, KEY_QUOTA_COUNT, QUOTA_CHECK, QUOTA_COUNT, REBUILT,
                                    DailyQuota, QuotaUnavailable, counter_key, held_value, key_counter_key)
from flatfare import contract
from flatfare.contract import Job, Lane
from flatfare.gateway.errors import APIError
from flatfare.redis_conn import REDIS_DOWN

# KEYS: 1 the day's quota counter, 2 the quota epoch marker, 3 where the job goes (the account's queue
# on its lane, or a worker's own stream), 4 this gateway process's held units, 5 the key's counter of
# the day, 6 the account's in-flight set, 7 the key's in-flight set, 8 the lane's queued counter, 9 the
# lane's ring of accounts, 10 the pool's wake stream. ARGV: 1 daily limit (-1: none), 2 counter expiry,
# 3 lane bound, 4 consumer group, 5 request id, 6 the held value ("account:day:key"), 7 the key's daily
# cap (-1: none; '': no key counted), 8 the account's in-flight cap (-1: none), 9 the key's in-flight
# cap (-1: none; '': no key), 10 now (ms), 11 when the in-flight entry stops counting (ms), 12 the
# account id, 13 'fair' (the account's queue) or 'direct' (a worker's stream), 14... the job's fields.
# Returns {-1, 0}: counters being rebuilt; {0, used}: quota spent; {3, used, key used}: the key's cap
# reached; {4, used, in flight}: the account's in-flight cap; {5, used, in flight}: the key's;
# {2, used, queued}: lane full; {1, used, queued, entry id, generation, key used}: counted, held, queued.
# In-flight entries of requests that ended are removed by the worker with the terminal reply (and by
# the gateway when it settles); a dead process's expire at ARGV[11]. Every request is in its account's
# set, capped or not: the set is also how a gateway tells, after Redis lost its data, a lost job from
# a live one.
_ADMIT_COUNTED = QUOTA_CHECK + KEY_QUOTA_CHECK + """
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', ARGV[10])
local inflight = redis.call('ZCARD', KEYS[6])
if ARGV[8] ~= '-1' and inflight >= tonumber(ARGV[8]) then return {4, used, inflight} end
if ARGV[9] ~= '' then
    redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', ARGV[10])
    local key_inflight = redis.call('ZCARD', KEYS[7])
    if ARGV[9] ~= '-1' and key_inflight >= tonumber(ARGV[9]) then return {5, used, key_inflight} end
end
local fair = ARGV[13] == 'fair'
local queued
if fair then
    queued = tonumber(redis.call('GET', KEYS[8]) or '0')
else
    local ok, pending = pcall(redis.call, 'XPENDING', KEYS[3], ARGV[4])
    queued = redis.call('XLEN', KEYS[3]) - (ok and pending[1] or 0)
end
if queued >= tonumber(ARGV[3]) then return {2, used, queued} end
""" + QUOTA_COUNT + KEY_QUOTA_COUNT + """
redis.call('HSET', KEYS[4], ARGV[5], ARGV[6])
redis.call('ZADD', KEYS[6], ARGV[11], ARGV[5])
if ARGV[9] ~= '' then redis.call('ZADD', KEYS[7], ARGV[11], ARGV[5]) end
local fields = {}
for i = 14, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[3], '*', unpack(fields))
if fair then
    redis.call('INCR', KEYS[8])
    if redis.call('XLEN', KEYS[3]) == 1 then redis.call('RPUSH', KEYS[9], ARGV[12]) end
end
redis.call('XADD', KEYS[10], 'MAXLEN', '~', 64, '*', 'j', 1)
return {1, used, queued + 1, id, generation, key_used}
"""
QUOTA_SPENT, ADMITTED, LANE_FULL, KEY_QUOTA_SPENT, ACCOUNT_BUSY, KEY_BUSY = 0, 1, 2, 3, 4, 5

# Take a job back out if no worker has been given it yet (atomic against the claim script). A job
# in its account's queue (KEYS: the queue, the lane's queued counter, the lane's ring; ARGV: entry id,
# account id) is still waiting while its entry is there; one routed to a worker's own stream (KEYS:
# the stream; ARGV: entry id, consumer group) while no worker has read it.
_WITHDRAW_FAIR = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DECR', KEYS[2])
if redis.call('XLEN', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[1])
    redis.call('LREM', KEYS[3], 0, ARGV[2])
end
return 1
"""
_WITHDRAW_DIRECT = """
local ok, held = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2], ARGV[1], ARGV[1], 1)
if ok and #held > 0 then return 0 end
return redis.call('XDEL', KEYS[1], ARGV[1])
"""


@dataclass(frozen=True, slots=True)
class LaneLimits:
    max_depth: int
    max_wait_s: float


class DrainRate:
    """Jobs per second workers took from a lane while it was backlogged: a capacity measure.

    Sampled from the lane's drained counter (at most every ``sample_every_s``) over the last
    ``window_s``. Only a backlog says what the workers can do: a lane seen empty at an admission
    forgets its samples, so an idle lane, or one whose jobs are claimed as they come (a slow engine
    takes a batch, runs it for seconds, then takes the next), never bounds a burst by a rate that
    measured demand instead of capacity. 0.0 means "not known": no bound from the rate."""

    def __init__(self, redis: aioredis.Redis, window_s: float = 10.0, sample_every_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._window_s = window_s
        self._every = sample_every_s
        self._clock = clock
        self._samples: dict[str, deque[tuple[float, int]]] = {}  # key -> (when, drained count), oldest first

    async def rate(self, model: str, lane: Lane) -> float:
        key = contract.drained_key(model, lane)
        samples = self._samples.setdefault(key, deque())
        now = self._clock()
        if not samples or now - samples[-1][0] >= self._every:
            samples.append((now, int(await self._redis.get(key) or 0)))
        while now - samples[0][0] > self._window_s:
            samples.popleft()
        (first, taken_then), (last, taken_now) = samples[0], samples[-1]
        if last - first < self._window_s / 2:
            return 0.0
        return max(taken_now - taken_then, 0) / (last - first)

    def saw(self, model: str, lane: Lane, queued: int) -> None:
        """An admission found ``queued`` jobs waiting on the lane; none: the backlog is over."""
        if queued == 0:
            self._samples.pop(contract.drained_key(model, lane), None)


def retry_after(queued: int, rate: float) -> int:
    """Seconds until the queue ahead would have drained at the recent rate (1 to 60)."""
    if rate <= 0:
        return 5
    return max(1, min(60, math.ceil(queued / rate)))


@dataclass(frozen=True, slots=True)
class Queued:
    """Where an admitted job waits: its account's queue on the lane (``lane`` set), or a worker's own
    stream (``lane`` None); ``depth``: the jobs waiting there, it included."""

    stream: str
    entry_id: str
    depth: int
    account_id: int = 0
    lane: Lane | None = None
    pool: str = ""


@dataclass(frozen=True, slots=True)
class QuotaClaim:
    """The unit a request asks to count: the account's counter for the day and its limit, and the
    API key's counter with the key's own cap (``key_id`` None: no key counted)."""

    account_id: int
    day: str
    limit: int | None
    expire_at: int
    key_id: int | None = None
    key_limit: int | None = None
    # Requests in flight (queued or running) the account, and the key, may have at once (None: no cap).
    max_inflight: int | None = None
    key_max_inflight: int | None = None
    # When an in-flight entry left by a process that died stops counting (unix ms; 0: an hour on).
    inflight_expires_ms: int = 0


@dataclass(frozen=True, slots=True)
class Admitted:
    """The quota count after the request was counted, where its job waits, and the counters'
    generation it was counted in (for giving the unit back); ``key_used``: the key's count after it
    (0 when the claim named no key)."""

    used: int
    queued: Queued
    generation: str
    key_used: int = 0


class QuotaSpent(Exception):
    """The account's daily allowance is spent (nothing was counted or queued)."""

    def __init__(self, used: int) -> None:
        super().__init__(used)
        self.used = used


class KeyQuotaSpent(QuotaSpent):
    """The API key's own daily cap is reached (nothing was counted or queued); ``used`` is the
    account's count, ``key_used`` the key's."""

    def __init__(self, used: int, key_used: int) -> None:
        super().__init__(used)
        self.key_used = key_used


class TooManyInFlight(Exception):
    """The account (or, with ``key`` True, the API key) has as many requests in flight as its cap
    allows (nothing was counted or queued)."""

    def __init__(self, inflight: int, key: bool = False) -> None:
        super().__init__(inflight)
        self.inflight = inflight
        self.key = key


class LaneQueue:
    def __init__(self, redis: aioredis.Redis, limits: dict[Lane, LaneLimits], quota: DailyQuota | None = None,
                 holder: str = "") -> None:
        self._redis = redis
        # This gateway process's held-units hash (contract.held_units): every admitted unit is held
        # there until its request settles.
        self.holder = holder or contract.held_units(uuid.uuid4().hex[:16])
        self._admit_counted = redis.register_script(_ADMIT_COUNTED)
        self._withdraw_fair = redis.register_script(_WITHDRAW_FAIR)
        self._withdraw_direct = redis.register_script(_WITHDRAW_DIRECT)
        self._limits = limits
        self._quota = quota
        self.drain = DrainRate(redis)

    async def admit(self, job: Job, pool: str, claim: QuotaClaim, stream: str | None = None) -> Admitted:
        """Count the request against its quota, hold the unit, and queue its job, in one script.

        Raises :class:`QuotaSpent` or :class:`KeyQuotaSpent` (nothing counted), 429 ``queue_full`` (nothing counted),
        :class:`~flatfare.billing.quota.QuotaUnavailable` when the script cannot run or the counters cannot be
        rebuilt, and redis-py's own error when Redis cannot be reached before it (for the lane's drain rate)."""
        max_depth, rate = await self._bound(job.lane, pool)
        fair = stream is None
        target = contract.account_queue(pool, job.lane, claim.account_id) if fair else stream
        no_key = claim.key_id is None
        keys = [counter_key(claim.account_id, claim.day), EPOCH_KEY, target, self.holder,
                key_counter_key(0 if no_key else claim.key_id, claim.day), contract.inflight_key(claim.account_id),
                contract.key_inflight_key(0 if no_key else claim.key_id), contract.queued_key(pool, job.lane),
                contract.lane_ring(pool, job.lane), contract.wake_stream(pool)]
        now_ms = int(time.time() * 1000)
        args = [_cap(claim.limit), claim.expire_at, max_depth, contract.POOL_GROUP, job.request_id,
                held_value(claim.account_id, claim.day, claim.key_id), "" if no_key else _cap(claim.key_limit),
                _cap(claim.max_inflight), "" if no_key else _cap(claim.key_max_inflight), now_ms,
                claim.inflight_expires_ms or now_ms + 3_600_000, claim.account_id, "fair" if fair else "direct", *_flat(job)]
        for _ in range(50):
            try:
                try:
                    # EVALSHA directly: redis-py's Script.__call__ adds an isinstance check against a
                    # Protocol class and copies its arguments, a visible cost on this path.
                    outcome, used, *rest = await self._redis.evalsha(self._admit_counted.sha, len(keys), *keys, *args)
                except NoScriptError:  # a restarted or flushed server: load it through redis-py
                    outcome, used, *rest = await self._admit_counted(keys=keys, args=args)
            except REDIS_DOWN as exc:
                raise QuotaUnavailable(str(exc)) from exc
            if outcome != REBUILT:
                break
            if self._quota is None:
                raise QuotaUnavailable("the quota counters were lost and this queue cannot rebuild them")
            await self._quota.rebuild(claim.day, not_counted=(job.request_id,))
        else:
            raise QuotaUnavailable("the quota counters are being rebuilt; retry shortly")
        if outcome == QUOTA_SPENT:
            raise QuotaSpent(int(used))
        if outcome == KEY_QUOTA_SPENT:
            raise KeyQuotaSpent(int(used), int(rest[0]))
        if outcome in (ACCOUNT_BUSY, KEY_BUSY):
            raise TooManyInFlight(int(rest[0]), key=outcome == KEY_BUSY)
        depth = int(rest[0])
        if fair:
            self.drain.saw(pool, job.lane, depth - 1 if outcome == ADMITTED else depth)
        if outcome == LANE_FULL:
            raise _full(job.lane, depth, retry_after(depth, rate))
        entry_id, generation = (value.decode() if isinstance(value, bytes) else value for value in rest[1:3])
        queued = Queued(target, entry_id, depth, claim.account_id, job.lane if fair else None, pool)
        return Admitted(int(used), queued, generation, int(rest[3]))

    async def _bound(self, lane: Lane, pool: str) -> tuple[int, float]:
        """The lane's depth bound now, and the drain rate it came from (0.0: not known)."""
        limits = self._limits[lane]
        rate = await self.drain.rate(pool, lane)
        if rate > 0:
            return min(limits.max_depth, max(1, int(rate * limits.max_wait_s))), rate
        return limits.max_depth, rate

    async def withdraw(self, queued: Queued) -> bool:
        """True if the job was still waiting and is now gone; False if a worker has it."""
        if queued.lane is None:
            return bool(await self._withdraw_direct(keys=[queued.stream], args=[queued.entry_id, contract.POOL_GROUP]))
        keys = [queued.stream, contract.queued_key(queued.pool, queued.lane), contract.lane_ring(queued.pool, queued.lane)]
        return bool(await self._withdraw_fair(keys=keys, args=[queued.entry_id, queued.account_id]))


def _cap(value: int | None) -> int:
    return -1 if value is None else value


def _flat(job: Job) -> list[str]:
    return [item for pair in job.to_fields().items() for item in pair]


def _full(lane: Lane, queued: int, seconds: int) -> APIError:
    return APIError(429, f"The {lane.value} queue is full ({queued} requests waiting); retry in {seconds} s.",
                    code="queue_full", headers={"Retry-After": str(seconds)})
