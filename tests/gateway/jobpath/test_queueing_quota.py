"""The gateway's side of admission (flatfare.gateway.jobpath.queueing) against a real redis-server: the
quota's check-and-count, the in-flight caps, the lane's bound and the job's XADD are one script, so a
refusal of any kind leaves nothing behind, exactly across gateway processes; counters lost with
Redis's data are rebuilt from the ledger first."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, counter_key, expiry
from flatfare import contract
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.errors import APIError
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue, QuotaClaim, QuotaSpent, TooManyInFlight
from flatfare.redis_conn import connect

POOL = "m"


@pytest.fixture
async def redis(redis):  # conftest's client, with the quota counters trusted (the epoch marker set)
    await redis.set(EPOCH_KEY, 1)
    return redis


def _claim(account: int, limit: int | None) -> QuotaClaim:
    window = quota_window("UTC", datetime.now(UTC))
    return QuotaClaim(account, window.day, limit, expiry(window.resets_at))


def _queue(redis, max_depth: int = 1000, ledger: dict[tuple[int, str], int] | None = None) -> LaneQueue:
    async def counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        return {k: v for k, v in (ledger or {}).items() if k[1] in days}

    return LaneQueue(redis, {lane: LaneLimits(max_depth, 60.0) for lane in Lane}, DailyQuota(redis, counts))


async def _waiting(redis, lane: Lane = Lane.STANDARD) -> int:
    """Jobs waiting on the lane, by its counter, checked against its accounts' queues."""
    counted = int(await redis.get(contract.queued_key(POOL, lane)) or 0)
    accounts = await redis.lrange(contract.lane_ring(POOL, lane), 0, -1)
    assert len(set(accounts)) == len(accounts), f"an account twice in the ring: {accounts}"
    queues = [await redis.xlen(contract.account_queue(POOL, lane, a.decode())) for a in accounts]
    assert all(queues) and sum(queues) == counted, f"counter {counted}, queues {queues}"
    return counted


def _job(i: int) -> Job:
    return Job(request_id=f"r{i}", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0, reply_to="ff:replies:g")


async def test_admit_counts_and_queues_exactly_the_limit_under_concurrency(redis) -> None:
    queue, claim = _queue(redis), _claim(1, 60)
    outcomes = await asyncio.gather(*(queue.admit(_job(i), POOL, claim) for i in range(200)),
                                    return_exceptions=True)
    admitted = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(admitted) == 60
    assert all(isinstance(o, QuotaSpent) for o in outcomes if isinstance(o, BaseException))
    assert int(await redis.get(counter_key(1, claim.day))) == 60
    assert await _waiting(redis) == 60
    assert await redis.zcard(contract.inflight_key(1)) == 60
    assert sorted(a.used for a in admitted) == list(range(1, 61))


async def test_a_full_lane_refuses_without_counting(redis) -> None:
    queue, claim = _queue(redis, max_depth=2), _claim(2, 60)
    for i in range(2):
        await queue.admit(_job(i), POOL, claim)
    with pytest.raises(APIError) as refused:
        await queue.admit(_job(2), POOL, claim)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert int(await redis.get(counter_key(2, claim.day))) == 2  # the refused one cost no unit
    assert await _waiting(redis) == 2 and await redis.zcard(contract.inflight_key(2)) == 2


async def test_a_spent_quota_queues_nothing(redis) -> None:
    queue, claim = _queue(redis), _claim(3, 1)
    await queue.admit(_job(0), POOL, claim)
    with pytest.raises(QuotaSpent) as spent:
        await queue.admit(_job(1), POOL, claim)
    assert spent.value.used == 1
    assert await _waiting(redis) == 1


async def test_lost_counters_are_rebuilt_from_the_ledger_before_admitting(redis) -> None:
    claim = _claim(4, 5)
    queue = _queue(redis, ledger={(4, claim.day): 4})
    await redis.flushdb()  # Redis lost its data: no epoch marker
    admitted = await queue.admit(_job(0), POOL, claim)
    assert admitted.used == 5  # the ledger's 4, then this one
    with pytest.raises(QuotaSpent):
        await queue.admit(_job(1), POOL, claim)


async def test_admission_survives_a_script_flush(redis) -> None:
    queue, claim = _queue(redis), _claim(5, 100)
    await redis.script_flush()  # a restarted server: the script is loaded again on first use
    admitted = await asyncio.gather(*(queue.admit(_job(i), POOL, claim) for i in range(20)))
    assert sorted(a.used for a in admitted) == list(range(1, 21))
    assert await _waiting(redis) == 20


async def _no_counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
    return {}


async def test_an_admitted_unit_is_held_and_given_back_at_most_once(redis) -> None:
    queue, claim = _queue(redis), _claim(6, 2)
    first = await queue.admit(_job(0), POOL, claim)
    await queue.admit(_job(1), POOL, claim)
    assert await redis.hgetall(queue.holder) == {b"r0": f"6:{claim.day}".encode(), b"r1": f"6:{claim.day}".encode()}
    quota = DailyQuota(redis, _no_counts)
    assert await quota.give_back(6, claim.day, "r0", queue.holder, first.generation)
    assert not await quota.give_back(6, claim.day, "r0", queue.holder, first.generation)  # a second time: nothing
    assert not await quota.give_back(6, claim.day, "never-held", queue.holder, "")
    assert int(await redis.get(counter_key(6, claim.day))) == 1
    assert await redis.hkeys(queue.holder) == [b"r1"]


async def test_a_unit_counted_before_a_rebuild_is_given_back_after_it(redis) -> None:
    claim = _claim(7, 5)
    queue = _queue(redis, ledger={(7, claim.day): 1})  # its open row, as the rebuild will find it
    admitted = await queue.admit(_job(0), POOL, claim)
    await redis.flushdb()  # the held hash is lost with the counters
    again = await queue.admit(_job(1), POOL, claim)
    assert again.used == 2 and again.generation != admitted.generation
    quota = DailyQuota(redis, _no_counts)
    assert await quota.give_back(7, claim.day, "r0", queue.holder, admitted.generation)
    assert int(await redis.get(counter_key(7, claim.day))) == 1


# -- requests in flight ---------------------------------------------------------------------------

def _inflight_claim(account: int, cap: int | None, key_id: int | None = None, key_cap: int | None = None,
                    limit: int | None = 1000) -> QuotaClaim:
    window = quota_window("UTC", datetime.now(UTC))
    return QuotaClaim(account, window.day, limit, expiry(window.resets_at), key_id, None, cap, key_cap,
                      int(time.time() * 1000) + 60_000)


async def test_the_inflight_cap_is_exact_across_gateway_processes_and_costs_nothing(redis, redis_url) -> None:
    """Two gateway processes (two clients, two queues) admit 100 requests of one account at once
    against a cap of 5: exactly 5 are in flight, and the 95 refusals counted no unit and queued
    nothing. When one request ends (its worker takes it out of the set), one more fits."""
    other = connect(redis_url)
    try:
        queues = [_queue(redis), _queue(other)]
        claim = _inflight_claim(20, 5)
        outcomes = await asyncio.gather(*(queues[i % 2].admit(_job(i), POOL, claim) for i in range(100)),
                                        return_exceptions=True)
    finally:
        await other.aclose()
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(refused) == 95 and all(isinstance(o, TooManyInFlight) and not o.key for o in refused)
    assert {o.inflight for o in refused} == {5}
    assert int(await redis.get(counter_key(20, claim.day))) == 5
    assert await _waiting(redis) == 5 and await redis.zcard(contract.inflight_key(20)) == 5
    with pytest.raises(TooManyInFlight):
        await _queue(redis).admit(_job(100), POOL, claim)
    await redis.zrem(contract.inflight_key(20), (await redis.zrange(contract.inflight_key(20), 0, 0))[0])
    again = await _queue(redis).admit(_job(101), POOL, claim)
    assert again.used == 6


async def test_the_key_inflight_cap_binds_below_the_account_s(redis) -> None:
    queue = _queue(redis)
    capped, free = _inflight_claim(21, 10, key_id=7, key_cap=2), _inflight_claim(21, 10, key_id=8)
    for i in range(2):
        await queue.admit(_job(i), POOL, capped)
    with pytest.raises(TooManyInFlight) as busy:
        await queue.admit(_job(2), POOL, capped)
    assert busy.value.key and busy.value.inflight == 2
    await queue.admit(_job(3), POOL, free)  # another key of the account is not held up
    assert int(await redis.get(counter_key(21, capped.day))) == 3
    assert await redis.zcard(contract.key_inflight_key(7)) == 2 and await redis.zcard(contract.inflight_key(21)) == 3


async def test_an_inflight_entry_left_by_a_dead_process_stops_counting_when_it_expires(redis) -> None:
    queue, claim = _queue(redis), _inflight_claim(22, 1)
    await queue.admit(_job(0), POOL, claim)
    with pytest.raises(TooManyInFlight):
        await queue.admit(_job(1), POOL, claim)
    await redis.zadd(contract.inflight_key(22), {"r0": time.time() * 1000 - 1})  # its time is up
    await queue.admit(_job(2), POOL, claim)
