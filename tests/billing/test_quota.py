"""The daily quota against a real redis-server: atomic, exact at the day boundary, rebuilt after a loss."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, QuotaUnavailable, counter_key
from flatfare.redis_conn import connect



def _quota(redis, ledger: dict[tuple[int, str], int] | None = None) -> DailyQuota:
    async def counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        return {k: v for k, v in (ledger or {}).items() if k[1] in days}

    return DailyQuota(redis, counts)


async def test_concurrent_takes_stop_exactly_at_the_limit(redis) -> None:
    quota = _quota(redis)
    window = quota_window("UTC", datetime.now(UTC))
    decisions = await asyncio.gather(*(quota.take(1, window.day, 60, window.resets_at) for _ in range(200)))
    assert sum(d.allowed for d in decisions) == 60
    assert await quota.used(1, window.day) == 60
    assert sorted(d.used for d in decisions if d.allowed) == list(range(1, 61))


async def test_day_boundary_with_an_injected_clock(redis) -> None:
    quota = _quota(redis)
    # Tonight's midnight (UTC), so the counters' expiry stays in the future whatever today is.
    midnight = quota_window("UTC", datetime.now(UTC)).resets_at
    late = quota_window("UTC", midnight - timedelta(milliseconds=100))
    early = quota_window("UTC", midnight + timedelta(milliseconds=100))
    assert (await quota.take(7, late.day, 1, late.resets_at)).allowed
    assert not (await quota.take(7, late.day, 1, late.resets_at)).allowed
    assert (await quota.take(7, early.day, 1, early.resets_at)).allowed  # a new day, a new allowance
    ttl = await redis.ttl(counter_key(7, late.day))
    assert ttl > 0  # counters expire on their own


async def test_unlimited_accounts_are_counted_but_never_refused(redis) -> None:
    quota = _quota(redis)
    window = quota_window("UTC", datetime.now(UTC))
    decisions = [await quota.take(5, window.day, None, window.resets_at) for _ in range(5)]
    assert all(d.allowed and d.remaining is None for d in decisions) and decisions[-1].used == 5


async def test_counters_are_rebuilt_from_the_ledger_after_a_redis_loss(redis) -> None:
    window = quota_window("UTC", datetime.now(UTC))
    quota = _quota(redis, {(9, window.day): 59})
    await quota.take(9, window.day, 60, window.resets_at)
    await redis.flushall()  # Redis lost everything: counters and the epoch marker
    decision = await quota.take(9, window.day, 60, window.resets_at)
    assert decision.allowed and decision.used == 60  # 59 from the ledger, plus this one
    assert not (await quota.take(9, window.day, 60, window.resets_at)).allowed
    assert await redis.exists(EPOCH_KEY)


async def test_unreachable_redis_fails_closed() -> None:
    client = connect("redis://127.0.0.1:1/0")
    quota = _quota(client)
    window = quota_window("UTC", datetime.now(UTC))
    with pytest.raises(QuotaUnavailable):
        await quota.take(1, window.day, 60, window.resets_at)
    await client.aclose()
