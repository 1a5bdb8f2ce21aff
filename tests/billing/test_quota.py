"""The daily quota against a real redis-server, counted where production counts it: the gateway's
admission script (``LaneQueue.admit`` runs the quota's Lua with the lane's bound and the XADD). Atomic
across gateways, exact at the day boundary, rebuilt after a loss, closed while Redis is away."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from redis.exceptions import RedisError

from flatfare import contract
from flatfare.billing.plans import QuotaWindow, quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, QuotaUnavailable, counter_key, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.jobpath.queueing import Admitted, LaneLimits, LaneQueue, QuotaClaim, QuotaSpent
from flatfare.gateway.quota_headers import ratelimit_headers
from flatfare.redis_conn import connect

POOL = "m"


def _quota(redis, ledger: dict[tuple[int, str], int] | None = None) -> DailyQuota:
    async def counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        return {k: v for k, v in (ledger or {}).items() if k[1] in days}

    return DailyQuota(redis, counts)


def _queue(redis, quota: DailyQuota) -> LaneQueue:
    """One gateway process's admission (its own held-units hash); lanes deep enough never to refuse."""
    return LaneQueue(redis, {lane: LaneLimits(10_000, 60.0) for lane in Lane}, quota)


def _claim(account_id: int, window: QuotaWindow, limit: int | None) -> QuotaClaim:
    return QuotaClaim(account_id, window.day, limit, expiry(window.resets_at))


def _job(n: int) -> Job:
    return Job(request_id=f"r{n}", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0)


async def _used(queue: LaneQueue, n: int, claim: QuotaClaim) -> int | None:
    """The count after request ``n`` was admitted, or None if the quota refused it."""
    try:
        admitted: Admitted = await queue.admit(_job(n), POOL, claim)
    except QuotaSpent:
        return None
    return admitted.used


async def test_concurrent_admissions_of_two_gateways_stop_exactly_at_the_limit(redis, redis_url) -> None:
    await redis.set(EPOCH_KEY, "g1")
    other = connect(redis_url)  # a second gateway process: its own connections, its own held units
    try:
        quota = _quota(redis)
        gateways = [_queue(redis, quota), _queue(other, _quota(other))]
        claim = _claim(1, quota_window("UTC", datetime.now(UTC)), 60)
        used = await asyncio.gather(*(_used(gateways[n % 2], n, claim) for n in range(200)))
    finally:
        await other.aclose()
    assert sorted(u for u in used if u is not None) == list(range(1, 61))
    assert await quota.used(1, claim.day) == 60
    assert await redis.get(contract.queued_key(POOL, Lane.STANDARD)) == b"60"  # a refused request queues nothing


async def test_requests_100_ms_either_side_of_midnight_count_against_their_own_days(redis) -> None:
    """The quota day comes from the time the caller passes to quota_window (no clock is read here):
    a claim made just before midnight and one just after land on two counters, each with its own
    allowance, and each counter expires on its own."""
    await redis.set(EPOCH_KEY, "g1")
    queue = _queue(redis, _quota(redis))
    # Tonight's midnight (UTC), so the counters' expiry stays in the future whatever today is.
    midnight = quota_window("UTC", datetime.now(UTC)).resets_at
    late = _claim(7, quota_window("UTC", midnight - timedelta(milliseconds=100)), 1)
    early = _claim(7, quota_window("UTC", midnight + timedelta(milliseconds=100)), 1)
    assert late.day != early.day
    assert await _used(queue, 0, late) == 1
    assert await _used(queue, 1, late) is None
    assert await _used(queue, 2, early) == 1  # a new day, a new allowance
    ttl = await redis.ttl(counter_key(7, late.day))
    assert ttl > 0  # counters expire on their own


async def test_unlimited_accounts_are_counted_but_never_refused(redis) -> None:
    await redis.set(EPOCH_KEY, "g1")
    queue = _queue(redis, _quota(redis))
    now = datetime.now(UTC)
    window = quota_window("UTC", now)
    used = [await _used(queue, n, _claim(5, window, None)) for n in range(5)]
    assert used == [1, 2, 3, 4, 5]
    assert ratelimit_headers(None, 5, window, now) == {}  # nothing to count down


async def test_counters_are_rebuilt_from_the_ledger_after_a_redis_loss(redis) -> None:
    window = quota_window("UTC", datetime.now(UTC))
    queue = _queue(redis, _quota(redis, {(9, window.day): 59}))
    claim = _claim(9, window, 60)
    assert await _used(queue, 0, claim) == 60  # no epoch marker yet: rebuilt first, 59 + this one
    await redis.flushall()  # Redis lost everything: counters and the epoch marker
    assert await _used(queue, 1, claim) == 60  # 59 from the ledger, plus this one
    assert await _used(queue, 2, claim) is None
    assert await redis.exists(EPOCH_KEY)


async def test_unreachable_redis_fails_closed() -> None:
    client = connect("redis://127.0.0.1:1/0")
    queue = _queue(client, _quota(client))
    claim = _claim(1, quota_window("UTC", datetime.now(UTC)), 60)
    # Production answers either with 503 (quota_unavailable, queue_unavailable): never let through.
    with pytest.raises((QuotaUnavailable, RedisError)):
        await queue.admit(_job(0), POOL, claim)
    await client.aclose()
