"""Putting jobs on a lane, with backpressure: a full lane answers at once instead of queueing without
bound, and its Retry-After comes from how fast the lane has been draining. A lane's maximum wait
becomes a depth bound at its recent drain rate, so both bounds are one atomic check-and-add."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Job, Lane
from gateway.errors import APIError

# Queued = entries not yet delivered to any worker: the stream's length minus the pending ones
# (delivered, not yet acknowledged; acknowledged entries are deleted). Checked and added atomically.
_ADMIT = """
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2])
local queued = redis.call('XLEN', KEYS[1]) - (ok and pending[1] or 0)
if queued >= tonumber(ARGV[1]) then return {0, queued} end
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
return {1, queued + 1, id}
"""

# Take a job back out of its stream if no worker has been given it yet (atomic against XREADGROUP).
_WITHDRAW = """
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
    stream: str
    entry_id: str
    depth: int


class LaneQueue:
    def __init__(self, redis: aioredis.Redis, limits: dict[Lane, LaneLimits]) -> None:
        self._redis = redis
        self._admit = redis.register_script(_ADMIT)
        self._withdraw = redis.register_script(_WITHDRAW)
        self._limits = limits
        self.drain = DrainRate(redis)

    async def submit(self, job: Job, pool: str, stream: str | None = None) -> Queued:
        """Queue ``job`` on its lane of ``pool`` (or on a routed worker's ``stream``).

        Raises 429 with Retry-After when the lane holds its maximum depth, or as many jobs as it
        drains in its maximum wait at the recent drain rate.
        """
        limits = self._limits[job.lane]
        rate = await self.drain.rate(pool, job.lane)
        max_depth = limits.max_depth
        if rate > 0:
            max_depth = min(max_depth, max(1, int(rate * limits.max_wait_s)))
        target = stream or contract.job_stream(pool, job.lane)
        allowed, depth, *entry = await self._admit(keys=[target], args=[max_depth, contract.POOL_GROUP, *_flat(job)])
        if stream is None:
            self.drain.saw(pool, job.lane, int(depth) - 1 if allowed else int(depth))
        if not allowed:
            raise _full(job.lane, int(depth), retry_after(int(depth), rate))
        entry_id = entry[0].decode() if isinstance(entry[0], bytes) else entry[0]
        return Queued(stream=target, entry_id=entry_id, depth=int(depth))

    async def withdraw(self, queued: Queued) -> bool:
        """True if the job was still waiting and is now gone; False if a worker has it."""
        return bool(await self._withdraw(keys=[queued.stream], args=[queued.entry_id, contract.POOL_GROUP]))


def _flat(job: Job) -> list[str]:
    return [item for pair in job.to_fields().items() for item in pair]


def _full(lane: Lane, queued: int, seconds: int) -> APIError:
    return APIError(429, f"The {lane.value} queue is full ({queued} requests waiting); retry in {seconds} s.",
                    code="queue_full", headers={"Retry-After": str(seconds)})
