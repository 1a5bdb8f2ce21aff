"""The gateway's side of the lane queue (:mod:`flatfare.lanes`): backpressure and refusals around its one
admission script. A full lane answers at once instead of queueing without bound, and its Retry-After
comes from how fast the lane has been draining: a lane's maximum wait becomes a depth bound at its
recent drain rate, which the script checks with the rest, atomically. The script's refusals become
the exceptions the service answers with; counters lost with Redis's data are rebuilt from the
ledger (flatfare.billing.quota) before the request is admitted."""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.billing.quota import DailyQuota, QuotaUnavailable, held_value
from flatfare.contract import Job, Lane
from flatfare.lanes import admit as lanes
from flatfare.lanes.admit import Queued, QuotaClaim, Verdict
from flatfare.gateway.errors import APIError
from flatfare.redis_conn import REDIS_DOWN

__all__ = ["Admitted", "DrainRate", "KeyQuotaSpent", "KeyShared", "LaneLimits", "LaneQueue", "Queued", "QuotaClaim",
           "QuotaSpent", "TooManyInFlight", "retry_after"]


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
    measured demand instead of capacity. Until a new backlog has lasted half the window, the rate the
    last one measured stands (the third GPU rehearsal's bursts came every few seconds, each forgetting the
    last one's rate: admitted at the static depth bound, 7 % of the standard requests then waited 1.5-7.7 s,
    past the lane's 1.5 s limit). 0.0 means "not known" (no backlog measured yet): no bound from the rate.
    The counter is read at most every ``sample_every_s`` whatever the lane's state, so a backlog's first
    sample comes up to that long after it began (a GET on every admission of an idle lane, to restart the
    samples at once, was 7-10 % of the gateway's CPU on the instant engine)."""

    def __init__(self, redis: aioredis.Redis, window_s: float = 10.0, sample_every_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._window_s = window_s
        self._every = sample_every_s
        self._clock = clock
        self._samples: dict[str, deque[tuple[float, int]]] = {}  # key -> (when, drained count), oldest first
        self._measured: dict[str, float] = {}  # key -> the rate its last backlog measured
        self._read_at: dict[str, float] = {}  # key -> when its counter was last read

    async def rate(self, model: str, lane: Lane) -> float:
        key = contract.drained_key(model, lane)
        samples = self._samples.setdefault(key, deque())
        now = self._clock()
        if now - self._read_at.get(key, -math.inf) >= self._every:
            self._read_at[key] = now
            samples.append((now, int(await self._redis.get(key) or 0)))
        while samples and now - samples[0][0] > self._window_s:
            samples.popleft()
        if not samples:
            return self._measured.get(key, 0.0)
        (first, taken_then), (last, taken_now) = samples[0], samples[-1]
        if last - first < self._window_s / 2:
            return self._measured.get(key, 0.0)
        self._measured[key] = max(taken_now - taken_then, 0) / (last - first)
        return self._measured[key]

    def saw(self, model: str, lane: Lane, queued: int) -> None:
        """An admission found ``queued`` jobs waiting on the lane; none: the backlog is over, and its samples
        go (a sample kept across an idle lane would measure demand: a rate of the few jobs that came while
        nothing waited, which then bounds the next burst)."""
        if queued == 0:
            self._samples.pop(contract.drained_key(model, lane), None)


def retry_after(queued: int, rate: float) -> int:
    """Seconds until the queue ahead would have drained at the recent rate (1 to 60)."""
    if rate <= 0:
        return 5
    return max(1, min(60, math.ceil(queued / rate)))


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


class KeyShared(TooManyInFlight):
    """The API key was used from as many other addresses within its plan's window as the plan allows at
    once, and this request came from yet another (nothing was counted, queued or recorded); ``inflight``
    is that number of addresses."""


class LaneQueue:
    def __init__(self, redis: aioredis.Redis, limits: dict[Lane, LaneLimits], quota: DailyQuota | None = None,
                 holder: str = "") -> None:
        self._redis = redis
        # This gateway process's held-units hash (contract.held_units): every admitted unit is held
        # there until its request settles.
        self.holder = holder or contract.held_units(uuid.uuid4().hex[:16])
        self._limits = limits
        self._quota = quota
        self.drain = DrainRate(redis)

    async def admit(self, job: Job, pool: str, claim: QuotaClaim, stream: str | None = None) -> Admitted:
        """Count the request against its quota, hold the unit, and queue its job, in one script.

        Raises :class:`QuotaSpent` or :class:`KeyQuotaSpent` (nothing counted), 429 ``queue_full`` (nothing counted),
        :class:`~flatfare.billing.quota.QuotaUnavailable` when the script cannot run or the counters cannot be
        rebuilt, and redis-py's own error when Redis cannot be reached before it (for the lane's drain rate)."""
        max_depth, rate = await self._bound(job.lane, pool)
        held = held_value(claim.account_id, claim.day, claim.key_id)
        for _ in range(50):
            try:
                answer = await lanes.admit(self._redis, job, pool, claim, holder=self.holder, held=held,
                                           max_depth=max_depth, stream=stream)
            except REDIS_DOWN as exc:
                raise QuotaUnavailable(str(exc)) from exc
            if answer.verdict is not Verdict.REBUILDING:
                break
            if self._quota is None:
                raise QuotaUnavailable("the quota counters were lost and this queue cannot rebuild them")
            await self._quota.rebuild(claim.day, not_counted=(job.request_id,))
        else:
            raise QuotaUnavailable("the quota counters are being rebuilt; retry shortly")
        verdict = answer.verdict
        if verdict is Verdict.QUOTA_SPENT:
            raise QuotaSpent(answer.used)
        if verdict is Verdict.KEY_QUOTA_SPENT:
            raise KeyQuotaSpent(answer.used, answer.key_used)
        if verdict is Verdict.KEY_SHARED:
            raise KeyShared(answer.inflight, key=True)
        if verdict in (Verdict.ACCOUNT_BUSY, Verdict.KEY_BUSY):
            raise TooManyInFlight(answer.inflight, key=verdict is Verdict.KEY_BUSY)
        if stream is None:
            self.drain.saw(pool, job.lane, answer.depth - 1 if verdict is Verdict.ADMITTED else answer.depth)
        if verdict is Verdict.LANE_FULL:
            raise _full(job.lane, answer.depth, retry_after(answer.depth, rate))
        assert answer.queued is not None
        return Admitted(answer.used, answer.queued, answer.generation, answer.key_used)

    async def _bound(self, lane: Lane, pool: str) -> tuple[int, float]:
        """The lane's depth bound now, and the drain rate it came from (0.0: not known)."""
        limits = self._limits[lane]
        rate = await self.drain.rate(pool, lane)
        if rate > 0:
            return min(limits.max_depth, max(1, int(rate * limits.max_wait_s))), rate
        return limits.max_depth, rate

    async def withdraw(self, queued: Queued) -> bool:
        """True if the job was still waiting and is now gone; False if a worker has it."""
        return await lanes.withdraw(self._redis, queued)


def _full(lane: Lane, queued: int, seconds: int) -> APIError:
    return APIError(429, f"The {lane.value} queue is full ({queued} requests waiting); retry in {seconds} s.",
                    code="queue_full", headers={"Retry-After": str(seconds)})
