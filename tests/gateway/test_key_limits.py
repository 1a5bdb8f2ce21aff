"""A key's own daily cap, against real Redis and SQL: claimed in the same admission script as its
account's quota, so it is exact across gateway processes and a refusal counts nothing; every way a
unit comes back (a free request, the reaper, an admission whose answer was lost) returns it to the
key too, once; and a rebuild after a Redis loss restores each key's counter from the ledger."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from flatfare import contract
from flatfare.billing.held import HeldUnits
from flatfare.billing.ledger import Charge, Ledger, Outcome
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, counter_key, expiry, key_counter_key
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.jobpath.queueing import Admitted, KeyQuotaSpent, LaneLimits, LaneQueue, QuotaClaim
from flatfare.redis_conn import connect
from flatfare.storage.accounts import IssuedKey, issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.models import RequestStatus

POOL = "m"


async def _no_counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
    return {}


def _queue(redis, quota: DailyQuota, holder: str = "") -> LaneQueue:
    """One gateway process's admission (its own held-units hash); lanes deep enough never to refuse."""
    return LaneQueue(redis, {lane: LaneLimits(10_000, 60.0) for lane in Lane}, quota, holder)


def _claim(account_id: int, key_id: int, key_limit: int | None, limit: int | None = 1000) -> QuotaClaim:
    window = quota_window("UTC", datetime.now(UTC))
    return QuotaClaim(account_id, window.day, limit, expiry(window.resets_at), key_id, key_limit)


def _job(request_id: str) -> Job:
    return Job(request_id=request_id, endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0)


async def _count(redis, key: str) -> int:
    return int(await redis.get(key) or 0)


async def test_a_keys_cap_holds_exactly_across_two_gateways_and_a_refusal_counts_nothing(redis, redis_url) -> None:
    await redis.set(EPOCH_KEY, "g1")
    other = connect(redis_url)  # a second gateway process: its own connections, its own held units
    try:
        gateways = [_queue(redis, DailyQuota(redis, _no_counts)), _queue(other, DailyQuota(other, _no_counts))]
        claim = _claim(1, 11, key_limit=15)

        async def admit(n: int) -> Admitted | BaseException:
            try:
                return await gateways[n % 2].admit(_job(f"r{n}"), POOL, claim)
            except KeyQuotaSpent as spent:
                return spent

        outcomes = await asyncio.gather(*(admit(n) for n in range(45)))
        # Another key of the same account has its own counter: the first key's cap does not touch it.
        await gateways[0].admit(_job("other-key"), POOL, _claim(1, 12, key_limit=15))
    finally:
        await other.aclose()
    admitted = [o for o in outcomes if isinstance(o, Admitted)]
    refused = [o for o in outcomes if isinstance(o, KeyQuotaSpent)]
    assert (len(admitted), len(refused)) == (15, 30)
    assert sorted(a.used for a in admitted) == list(range(1, 16))
    assert {r.key_used for r in refused} == {15}
    assert await _count(redis, key_counter_key(11, claim.day)) == 15
    assert await _count(redis, key_counter_key(12, claim.day)) == 1
    # The thirty refusals counted nothing for the account, queued nothing and hold nothing.
    assert await _count(redis, counter_key(1, claim.day)) == 16
    assert await redis.get(contract.queued_key(POOL, Lane.STANDARD)) == b"16"
    held = [v for g in gateways for v in (await redis.hgetall(g.holder)).values()]
    assert sorted(held) == sorted([f"1:{claim.day}:11".encode()] * 15 + [f"1:{claim.day}:12".encode()])


async def test_a_unit_given_back_returns_to_the_key_once_and_frees_its_cap(redis) -> None:
    await redis.set(EPOCH_KEY, "g1")
    quota = DailyQuota(redis, _no_counts)
    queue, claim = _queue(redis, quota), _claim(2, 21, key_limit=2)
    first = await queue.admit(_job("r0"), POOL, claim)
    await queue.admit(_job("r1"), POOL, claim)
    with pytest.raises(KeyQuotaSpent):
        await queue.admit(_job("r2"), POOL, claim)
    # r0 failed before its first token: the service gives its unit back (CompletionService._give_back).
    assert await quota.give_back(2, claim.day, "r0", queue.holder, first.generation, 21)
    assert not await quota.give_back(2, claim.day, "r0", queue.holder, first.generation, 21)  # once only
    assert await _count(redis, key_counter_key(21, claim.day)) == 1
    assert await _count(redis, counter_key(2, claim.day)) == 1
    await queue.admit(_job("r3"), POOL, claim)  # the key's unit is free again
    assert await _count(redis, key_counter_key(21, claim.day)) == 2


async def _account_with_key(sessions, name: str) -> IssuedKey:
    async with sessions() as session:
        issued = await issue_key(session, await ensure_account(session, name, "pro"))
        await session.commit()
    return issued


async def _row(ledger: Ledger, request_id: str, issued: IssuedKey, day: str, outcome: Outcome | None) -> None:
    await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint="chat", stream=False, created_at=datetime.now(UTC),
                      charge=Charge(plan="pro", price_micros=1000, quota_day=day))
    if outcome is not None:
        await ledger.close(request_id, outcome)


async def test_the_reaper_gives_a_dead_gateways_units_back_to_their_keys(redis, sessions) -> None:
    await redis.set(EPOCH_KEY, "g0")
    issued = await _account_with_key(sessions, "acme")
    ledger = Ledger(sessions)
    quota = DailyQuota(redis, ledger.billable_counts, ledger.billable_key_counts)
    claim = _claim(issued.account_id, issued.key_id, key_limit=10)
    dead = _queue(redis, quota, contract.held_units("dead"))
    for i in range(3):
        await dead.admit(_job(f"r{i}"), POOL, claim)
    # r0 was charged (its release never flushed), r1 is mid-run, r2 died before its row was written.
    await _row(ledger, "r0", issued, claim.day, Outcome(RequestStatus.SUCCEEDED, 200))
    await _row(ledger, "r1", issued, claim.day, None)
    await redis.zadd(contract.GATEWAYS_KEY, {"dead": int(time.time() * 1000) - 60_000})
    reaper = HeldUnits(redis, "alive", ledger, quota, dead_after_s=30)
    assert await reaper.reap() == 2
    assert await reaper.reap() == 0
    assert await _count(redis, key_counter_key(issued.key_id, claim.day)) == 1  # r0's only
    assert await _count(redis, counter_key(issued.account_id, claim.day)) == 1
    ledger.dispose()


async def test_an_admission_whose_answer_was_lost_gives_the_keys_unit_back(redis, sessions) -> None:
    await redis.set(EPOCH_KEY, "g0")
    ledger = Ledger(sessions)
    quota = DailyQuota(redis, ledger.billable_counts, ledger.billable_key_counts)
    held = HeldUnits(redis, "me", ledger, quota, dead_after_s=30)
    queue, claim = _queue(redis, quota, held.key), _claim(7, 71, key_limit=10)
    await queue.admit(_job("ran"), POOL, claim)
    await queue.admit(_job("kept"), POOL, claim)
    held.give_back_later(7, claim.day, "ran", "", 71)
    held.start()
    try:
        deadline = time.monotonic() + 10
        while await redis.hexists(held.key, "ran"):
            assert time.monotonic() < deadline, "the unit of the admission whose answer was lost is still held"
            await asyncio.sleep(0.05)
    finally:
        await held.stop()
    assert await _count(redis, key_counter_key(71, claim.day)) == 1  # "kept"'s unit only
    assert await _count(redis, counter_key(7, claim.day)) == 1
    ledger.dispose()


async def test_a_rebuild_after_a_redis_loss_restores_each_keys_counter_from_the_ledger(redis, sessions) -> None:
    first = await _account_with_key(sessions, "acme")
    async with sessions() as session:  # a second key of the same account
        second = await issue_key(session, await ensure_account(session, "acme"))
        await session.commit()
    ledger = Ledger(sessions)
    day = quota_window("UTC", datetime.now(UTC)).day
    for i in range(3):
        await _row(ledger, f"a{i}", first, day, Outcome(RequestStatus.SUCCEEDED, 200))
    await _row(ledger, "a-free", first, day, Outcome(RequestStatus.FAILED, 502, billable=False))
    for i in range(2):
        await _row(ledger, f"b{i}", second, day, Outcome(RequestStatus.SUCCEEDED, 200))
    await redis.flushall()  # Redis lost everything: counters, the epoch marker
    # Counters without the epoch marker are not trusted: the rebuild replaces them.
    await redis.set(key_counter_key(first.key_id, day), 40)  # the ledger says 3
    await redis.set(key_counter_key(999, day), 5)  # a key without rows that day
    queue = _queue(redis, DailyQuota(redis, ledger.billable_counts, ledger.billable_key_counts))
    claim = _claim(first.account_id, first.key_id, key_limit=4)
    admitted = await queue.admit(_job("new"), POOL, claim)  # rebuilt first: 3 from the ledger, plus this one
    assert admitted.used == 6
    assert await _count(redis, key_counter_key(first.key_id, day)) == 4
    assert await _count(redis, key_counter_key(second.key_id, day)) == 2
    assert not await redis.exists(key_counter_key(999, day))
    with pytest.raises(KeyQuotaSpent):
        await queue.admit(_job("over"), POOL, claim)
    ledger.dispose()
