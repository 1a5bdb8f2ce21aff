"""Admission in one round trip, against a real redis-server: the quota's check-and-count, the lane's
bound and the job's XADD are one script, so a refusal of either kind leaves nothing behind; and the
per-process reply stream routes every entry to its own request."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, counter_key, expiry
from flatfare import contract
from flatfare.contract import Endpoint, Job, Lane, Reply, ReplyKind, Usage
from flatfare.gateway.errors import APIError
from flatfare.gateway.queueing import LaneLimits, LaneQueue, QuotaClaim, QuotaSpent, TooManyInFlight
from flatfare.gateway.replies import ReplyRouter
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


async def test_the_reply_router_hands_each_entry_to_its_own_request(redis) -> None:
    clock = [1000.0]
    router = ReplyRouter(redis, timeout_s=5.0, gateway_id="g1", clock=lambda: clock[0])
    router.start()
    try:
        first, second = router.open("a"), router.open("b")
        stream = contract.gateway_replies("g1")
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, '{"n":1}', started_ms=5).to_fields("a"))
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, "stale").to_fields("gone"))  # nobody waits for it
        await redis.xadd(stream, Reply(ReplyKind.RESPONSE, "{}", usage=Usage(3, 4)).to_fields("b"))
        await redis.xadd(stream, Reply(ReplyKind.END, usage=Usage(1, 2)).to_fields("a"))
        replies_a: list[Reply] = []
        deadline = time.monotonic() + 10
        while not replies_a or not replies_a[-1].kind.terminal:
            assert time.monotonic() < deadline, f"no terminal reply for 'a' within 10 s: {replies_a}"
            replies_a += await first.next(2.0)
        assert [r.kind for r in replies_a] == [ReplyKind.CHUNK, ReplyKind.END]
        assert replies_a[0].data == '{"n":1}' and replies_a[0].started_ms == 5 and replies_a[1].usage == Usage(1, 2)
        replies_b = await second.next(2.0)
        assert [r.kind for r in replies_b] == [ReplyKind.RESPONSE] and replies_b[0].usage == Usage(3, 4)
        router.close(first)
        router.close(second)
        assert router.holding == 0
        # What was read is trimmed (every 512 entries, or when the TTL is renewed, every 5 s), and the
        # stream expires if this process dies.
        clock[0] += 10
        await redis.xadd(stream, Reply(ReplyKind.CHUNK, "x").to_fields("nobody"))
        for _ in range(50):
            if await redis.xlen(stream) <= 1:
                break
            await asyncio.sleep(0.05)
        assert await redis.xlen(stream) <= 1
        assert 0 < await redis.ttl(stream) <= contract.REPLY_TTL_S
    finally:
        await router.stop()


async def test_an_inbox_wait_ends_at_its_timeout_or_when_the_client_leaves(redis) -> None:
    router = ReplyRouter(redis, timeout_s=5.0, gateway_id="g2")
    inbox = router.open("c")
    assert await inbox.next(0.05) == []
    asyncio.get_running_loop().call_later(0.05, inbox.leave)
    assert await inbox.next(5.0) == [] and inbox.gone


async def test_admission_survives_a_script_flush(redis) -> None:
    queue, claim = _queue(redis), _claim(5, 100)
    await redis.script_flush()  # a restarted server: the script is loaded again on first use
    admitted = await asyncio.gather(*(queue.admit(_job(i), POOL, claim) for i in range(20)))
    assert sorted(a.used for a in admitted) == list(range(1, 21))
    assert await _waiting(redis) == 20


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


async def _no_counts(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
    return {}


async def test_after_a_loss_only_jobs_gone_from_redis_and_silent_are_answered_lost(redis) -> None:
    """Once the counters' generation changes, the router watches what it holds: a request still in
    its account's in-flight set is left alone (a false alarm), one whose worker says HELD lives on,
    and one gone from Redis and silent for ``lost_after_s`` (at two looks) gets 503 job_lost."""
    router = ReplyRouter(redis, timeout_s=60.0, gateway_id="g3", lost_after_s=1.0)
    await redis.set(EPOCH_KEY, "gen-1")
    router.start()
    try:
        inflight = contract.inflight_key(1)
        queued, held, lost = router.open("q"), router.open("h"), router.open("l")
        for inbox in (queued, held, lost):
            await redis.zadd(inflight, {inbox.request_id: time.time() * 1000 + 60_000})
            router.admitted(inbox, inflight, inbox.request_id, "gen-1")
        await redis.zrem(inflight, "h", "l")  # their entries went with the data
        await redis.set(EPOCH_KEY, "gen-2")
        replies = contract.gateway_replies("g3")
        answer: list[Reply] = []
        deadline = time.monotonic() + 20
        while not answer:  # the worker running "h" says so, every half second
            assert time.monotonic() < deadline, "the lost job was never answered"
            await redis.xadd(replies, Reply(ReplyKind.HELD).to_fields("h"))
            answer = await lost.next(0.5)
        assert [(r.kind, r.status) for r in answer] == [(ReplyKind.ERROR, 503)]
        assert '"job_lost"' in answer[0].data
        assert await queued.next(0.01) == [] and await held.next(0.01) == []  # HELD is not an answer
    finally:
        await router.stop()


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
