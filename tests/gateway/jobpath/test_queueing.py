"""Lane admission against a real redis-server: depth bounds, and the drain-rate bound that only a
sustained backlog may set. Jobs go in as production puts them, through ``LaneQueue.admit`` (the same
script counts the quota; here an unlimited account's, so only the lane's bound refuses)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.errors import APIError
from flatfare.gateway.jobpath.queueing import Admitted, DrainRate, LaneLimits, LaneQueue, QuotaClaim

POOL = "m"


@pytest.fixture
async def redis(redis):  # conftest's client, with the quota counters trusted (the epoch marker set)
    await redis.set(EPOCH_KEY, 1)
    return redis


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _queue(redis, clock: Clock, max_depth: int = 1000, max_wait_s: float = 2.0) -> LaneQueue:
    queue = LaneQueue(redis, {lane: LaneLimits(max_depth, max_wait_s) for lane in Lane})
    queue.drain = DrainRate(redis, window_s=10.0, sample_every_s=0.5, clock=clock)
    return queue


def _job(i: int) -> Job:
    return Job(request_id=f"r{i}", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0)


async def _admit(queue: LaneQueue, i: int) -> Admitted:
    window = quota_window("UTC", datetime.now(UTC))
    return await queue.admit(_job(i), POOL, QuotaClaim(1, window.day, None, expiry(window.resets_at)))


async def test_the_static_depth_bound_refuses_at_once(redis) -> None:
    queue = _queue(redis, Clock(), max_depth=3)
    for i in range(3):
        await _admit(queue, i)
    with pytest.raises(APIError) as refused:
        await _admit(queue, 3)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert await redis.get(contract.queued_key(POOL, Lane.STANDARD)) == b"3"  # nothing added


@pytest.mark.parametrize("every_s", [3, 6])  # within half the window, and past it
async def test_a_burst_after_a_trickle_is_not_bounded_by_the_trickle(redis, every_s: int) -> None:
    """A lane that drained one job every few seconds because only that many came says nothing about
    what its workers can do: a burst after it is queued, not refused."""
    clock = Clock()
    queue = _queue(redis, clock, max_wait_s=2.0)
    taken = [contract.account_queue(POOL, Lane.STANDARD, 1), contract.lane_ring(POOL, Lane.STANDARD),
             contract.queued_key(POOL, Lane.STANDARD)]
    for i in range(6):  # one request every few seconds, each taken at once: the lane is empty at every admission
        await _admit(queue, i)
        await redis.delete(*taken)
        await redis.incr(contract.drained_key(POOL, Lane.STANDARD))
        clock.now += every_s
    for i in range(6, 46):  # then forty at once
        await _admit(queue, i)
    assert await redis.get(contract.queued_key(POOL, Lane.STANDARD)) == b"40"


async def test_a_sustained_backlog_is_bounded_by_its_drain_rate(redis) -> None:
    clock = Clock()
    queue = _queue(redis, clock, max_wait_s=2.0)
    drained = contract.drained_key(POOL, Lane.STANDARD)
    for i in range(8):  # a backlog from the start
        await _admit(queue, i)
    refused = None
    for step in range(1, 12):  # workers take 3 jobs a second; 8 more arrive each second
        clock.now += 1
        await redis.incrby(drained, 3)
        try:
            for i in range(8):
                await _admit(queue, 100 * step + i)
        except APIError as exc:
            refused = exc
            break
    assert refused is not None and refused.status == 429 and refused.code == "queue_full"
    # Bounded once the backlog's samples span half the window (5 s), at 3 jobs/s x 2 s of waiting = 6,
    # which the 48 queued by then exceed; Retry-After is the time to drain them at 3/s. The first admission
    # found the lane empty and the counter is read once a sample period, so its first sample is at 1 s.
    assert step == 6
    assert "(48 requests waiting)" in refused.message
    assert refused.headers["Retry-After"] == "16"


async def test_a_burst_after_a_backlog_is_bounded_at_once_by_the_rate_that_backlog_measured(redis) -> None:
    """The third GPU rehearsal: bursts every few seconds, the lane empty between them; each burst had
    forgotten the last one's rate and queued up to the static bound, and admitted requests waited 1.5-7.7 s
    against a 1.5 s limit. A lane that once drained at 3 jobs/s under a backlog is bounded at once."""
    clock = Clock()
    queue = _queue(redis, clock, max_wait_s=2.0)
    drained = contract.drained_key(POOL, Lane.STANDARD)
    lane = [contract.account_queue(POOL, Lane.STANDARD, 1), contract.lane_ring(POOL, Lane.STANDARD),
            contract.queued_key(POOL, Lane.STANDARD)]
    for i in range(4):
        await _admit(queue, i)
    for step in range(1, 7):  # a backlog of 4 for 6 s: workers take 3 jobs a second, 3 more arrive
        clock.now += 1
        await redis.incrby(drained, 3)
        await redis.decrby(contract.queued_key(POOL, Lane.STANDARD), 3)
        for i in range(3):
            await _admit(queue, 100 * step + i)
    await redis.delete(*lane)  # the backlog is over: the lane empty at the next admission, then a burst
    admitted = 0
    with pytest.raises(APIError) as refused:
        for i in range(1000, 1040):  # a burst of forty
            await _admit(queue, i)
            admitted += 1
    assert refused.value.code == "queue_full"
    assert admitted == 6  # 3 jobs/s x 2 s of waiting: a depth of 6


class _CountingGets:
    """The test's Redis client, counting the GETs made through it."""

    def __init__(self, redis) -> None:  # noqa: ANN001 - redis.asyncio.Redis
        self._redis = redis
        self.gets = 0

    async def get(self, key: str) -> bytes | None:
        self.gets += 1
        return await self._redis.get(key)


async def test_an_idle_lane_reads_its_drained_counter_once_a_sample_period_not_once_an_admission(redis) -> None:
    """Each admission that finds its lane empty forgets the samples; reading the counter again for the next
    one put a Redis round trip on every request of an idle platform."""
    clock = Clock()
    queue = _queue(redis, clock)
    counting = _CountingGets(redis)
    queue.drain = DrainRate(counting, window_s=10.0, sample_every_s=0.5, clock=clock)  # type: ignore[arg-type]
    taken = [contract.account_queue(POOL, Lane.STANDARD, 1), contract.lane_ring(POOL, Lane.STANDARD),
             contract.queued_key(POOL, Lane.STANDARD)]
    for i in range(40):  # 40 requests in 2 s, each taken at once: the lane is empty at every admission
        await _admit(queue, i)
        await redis.delete(*taken)
        clock.now += 0.05
    assert counting.gets == 4  # at 0, 0.5, 1.0 and 1.5 s (each admission read it before)
