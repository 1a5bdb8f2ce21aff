"""The lane share: premium first, but standard keeps its guaranteed share; a claim pass, against a
real redis-server, in lane order within the worker's free slots; and within a lane, its accounts
served in turn (jobs put there by the gateway's own admission script)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.jobpath.queueing import Admitted, LaneLimits, LaneQueue, QuotaClaim
from flatfare.workers.claims import Claimed, Claimer, LaneShare


def test_standard_gets_one_claim_in_five_under_premium_load() -> None:
    share = LaneShare(0.2)
    served = []
    for _ in range(100):
        lane = Lane.STANDARD if share.standard_first() else Lane.PREMIUM
        share.took(lane, 1)
        served.append(lane)
    assert served.count(Lane.STANDARD) == 20
    assert Lane.STANDARD not in served[:4]  # premium goes first


def test_credit_is_bounded_after_a_long_premium_only_stretch() -> None:
    share = LaneShare(0.2)
    share.took(Lane.PREMIUM, 10_000)
    assert share.credit == 8.0



async def test_a_claim_pass_takes_own_then_premium_then_standard_within_free(redis) -> None:
    claimer = Claimer(redis, "m", "w1")
    await claimer.setup()
    for stream, count in ((claimer.own, 1), (claimer.lanes[Lane.PREMIUM], 2), (claimer.lanes[Lane.STANDARD], 3)):
        for i in range(count):
            await redis.xadd(stream, {"id": f"{stream}-{i}"})
    first = await claimer.claim(4, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in first] == [(None, 1), (Lane.PREMIUM, 2), (Lane.STANDARD, 1)]
    assert first[1].entries[0][1] == {b"id": f"{claimer.lanes[Lane.PREMIUM]}-0".encode()}
    rest = await claimer.claim(10, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in rest] == [(Lane.STANDARD, 2)]
    assert await claimer.claim(10, block_ms=10) == []  # nothing left: the blocking read times out


async def test_standard_is_served_first_once_it_has_earned_a_slot(redis) -> None:
    claimer = Claimer(redis, "m", "w2")
    await claimer.setup()
    claimer.share.credit = 1.0
    for lane in (Lane.PREMIUM, Lane.STANDARD):
        await redis.xadd(claimer.lanes[lane], {"id": lane.value})
    claimed = await claimer.claim(1, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in claimed] == [(Lane.STANDARD, 1)]


async def test_renewal_names_the_held_jobs_redis_lost(redis) -> None:
    """Renewing returns nothing while the entries are pending; after the data is gone (FLUSHALL, a
    restart without persistence) every held entry comes back as lost, and a group made again (the
    claim loop does that) does not hide the loss."""
    claimer = Claimer(redis, "m", "w3")
    await claimer.setup()
    premium, standard = claimer.lanes[Lane.PREMIUM], claimer.lanes[Lane.STANDARD]
    await redis.xadd(premium, {"id": "a"})
    await redis.xadd(standard, {"id": "b"})
    held: dict[str, list[bytes]] = {}
    for batch in await claimer.claim(2, block_ms=10):
        held[batch.stream] = [entry_id for entry_id, _ in batch.entries]
    assert sum(map(len, held.values())) == 2
    assert await claimer.renew(held) == set()
    await redis.flushall()
    everything = {(stream, entry_id) for stream, ids in held.items() for entry_id in ids}
    assert await claimer.renew(held) == everything
    await claimer.setup()
    assert await claimer.renew(held) == everything


# -- fair shares: the lane's accounts are served in turn -----------------------------------------

def _admitter(redis) -> LaneQueue:
    return LaneQueue(redis, {lane: LaneLimits(1000, 60.0) for lane in Lane})


async def _admit(queue: LaneQueue, request_id: str, account_id: int, lane: Lane = Lane.STANDARD,
                 pool: str = "m") -> Admitted:
    window = quota_window("UTC", datetime.now(UTC))
    job = Job(request_id, Endpoint.CHAT, "{}", 0, lane=lane, account_id=account_id)
    return await queue.admit(job, pool, QuotaClaim(account_id, window.day, None, expiry(window.resets_at),
                                                   inflight_expires_ms=int(time.time() * 1000) + 60_000))


def _ids(claimed: list[Claimed]) -> list[str]:
    return [fields[b"id"].decode() for batch in claimed for _, fields in batch.entries]


async def test_a_lane_serves_its_accounts_in_turn_not_in_arrival_order(redis) -> None:
    """One account queues ten jobs before two others queue two each: the claims alternate between
    the three accounts (one job each in turn), so the late ones do not wait behind the flood."""
    await redis.set(EPOCH_KEY, 1)
    queue, claimer = _admitter(redis), Claimer(redis, "m", "w4")
    await claimer.setup()
    for i in range(10):
        await _admit(queue, f"a{i}", 1)
    for i in range(2):
        await _admit(queue, f"b{i}", 2)
        await _admit(queue, f"c{i}", 3)
    assert _ids(await claimer.claim(7, block_ms=10)) == ["a0", "b0", "c0", "a1", "b1", "c1", "a2"]
    # The two short queues emptied and left the ring; the flood's account is served alone now.
    assert await redis.lrange(contract.lane_ring("m", Lane.STANDARD), 0, -1) == [b"1"]
    assert _ids(await claimer.claim(10, block_ms=10)) == [f"a{i}" for i in range(3, 10)]
    assert await redis.get(contract.queued_key("m", Lane.STANDARD)) == b"0"
    assert not await redis.exists(contract.lane_ring("m", Lane.STANDARD), contract.account_queue("m", Lane.STANDARD, 1))
    # Taken jobs are pending in the lane's stream under this worker's lease, as before.
    assert (await redis.xpending(claimer.lanes[Lane.STANDARD], contract.POOL_GROUP))["pending"] == 14


async def test_an_account_that_comes_back_joins_the_end_of_the_ring(redis) -> None:
    await redis.set(EPOCH_KEY, 1)
    queue, claimer = _admitter(redis), Claimer(redis, "m", "w5")
    await claimer.setup()
    await _admit(queue, "a0", 1)
    await _admit(queue, "b0", 2)
    await _admit(queue, "b1", 2)
    assert _ids(await claimer.claim(1, block_ms=10)) == ["a0"]  # account 1's queue is empty: it leaves
    await _admit(queue, "a1", 1)  # and comes back behind account 2
    assert _ids(await claimer.claim(3, block_ms=10)) == ["b0", "a1", "b1"]


async def test_the_premium_reserve_leaves_standard_jobs_queued(redis) -> None:
    """``standard_free``: the slots the standard lane may fill; premium may take the rest."""
    await redis.set(EPOCH_KEY, 1)
    queue, claimer = _admitter(redis), Claimer(redis, "m", "w6")
    await claimer.setup()
    for i in range(3):
        await _admit(queue, f"s{i}", 1)
    assert _ids(await claimer.claim(4, block_ms=10, standard_free=0)) == []
    await _admit(queue, "p0", 2, Lane.PREMIUM)
    assert _ids(await claimer.claim(4, block_ms=10, standard_free=1)) == ["p0", "s0"]


async def test_an_idle_claim_wakes_on_the_next_admission(redis) -> None:
    """The blocking wait watches the pool's wake stream from the id the pass saw: an admission
    while the worker waits ends the wait, and its job is taken by the same call."""
    await redis.set(EPOCH_KEY, 1)
    queue, claimer = _admitter(redis), Claimer(redis, "m", "w7")
    await claimer.setup()
    waiting = asyncio.create_task(claimer.claim(4, block_ms=30_000))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await _admit(queue, "late", 1)
    async with asyncio.timeout(10):
        assert _ids(await waiting) == ["late"]


async def test_a_withdrawn_job_leaves_its_queue_and_the_counts(redis) -> None:
    await redis.set(EPOCH_KEY, 1)
    queue, claimer = _admitter(redis), Claimer(redis, "m", "w8")
    await claimer.setup()
    first = await _admit(queue, "w0", 1)
    taken = await _admit(queue, "w1", 2)
    assert _ids(await claimer.claim(1, block_ms=10)) == ["w0"]
    assert not await queue.withdraw(first.queued)  # a worker has it
    assert await queue.withdraw(taken.queued)
    assert not await queue.withdraw(taken.queued)  # once only
    assert await redis.get(contract.queued_key("m", Lane.STANDARD)) == b"0"
    assert await redis.llen(contract.lane_ring("m", Lane.STANDARD)) == 0
    assert await claimer.claim(4, block_ms=10) == []


async def test_a_dead_worker_s_batch_jobs_are_taken_over(redis) -> None:
    dead, live = Claimer(redis, "m", "dead"), Claimer(redis, "m", "live")
    await dead.setup()
    for i in range(2):
        job = Job(f"batch_x-{i}", Endpoint.CHAT, "{}", 0, lane=Lane.BATCH, reply_to=contract.BATCH_REPLIES)
        await redis.xadd(contract.job_stream("m", Lane.BATCH), job.to_fields())
    assert sum(len(c.entries) for c in await dead.claim(2, block_ms=10, batch_free=2)) == 2
    time.sleep(0.05)
    taken = await live.take_over(4, lease_ms=10, live_workers={"live"})
    assert [(c.lane, c.reclaimed, len(c.entries)) for c in taken] == [(Lane.BATCH, True, 2)]
