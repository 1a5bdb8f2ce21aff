"""The batch lane in a worker's claim pass, against a real redis-server and the gateway's own admission
script: batch jobs only with slots beyond the live reserve and only while neither live lane has a job
waiting, so a live request admitted while a batch runs is claimed before the batch's remaining lines."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.queueing import LaneLimits, LaneQueue, QuotaClaim
from flatfare.workers.claims import Claimed, Claimer


async def _admit(redis, request_id: str, lane: Lane) -> None:
    queue = LaneQueue(redis, {lane: LaneLimits(1000, 60.0) for lane in contract.LIVE_LANES})
    window = quota_window("UTC", datetime.now(UTC))
    job = Job(request_id, Endpoint.CHAT, "{}", 0, lane=lane, account_id=1)
    await queue.admit(job, "m", QuotaClaim(1, window.day, None, expiry(window.resets_at),
                                           inflight_expires_ms=int(time.time() * 1000) + 60_000))


async def _feed(redis, count: int) -> None:
    """Batch lines as the dispatcher queues them: straight into the pool's batch lane."""
    for i in range(count):
        job = Job(f"batch_x-{i}", Endpoint.CHAT, "{}", 0, lane=Lane.BATCH, reply_to=contract.BATCH_REPLIES)
        await redis.xadd(contract.job_stream("m", Lane.BATCH), job.to_fields())


def _taken(claimed: list[Claimed]) -> list[tuple[Lane | None, str]]:
    return [(batch.lane, fields[b"id"].decode()) for batch in claimed for _, fields in batch.entries]


async def test_batch_jobs_fill_only_the_slots_beyond_the_live_reserve(redis) -> None:
    claimer = Claimer(redis, "m", "w1")
    await claimer.setup()
    await _feed(redis, 5)
    taken = _taken(await claimer.claim(4, block_ms=10, batch_free=3))
    assert taken == [(Lane.BATCH, f"batch_x-{i}") for i in range(3)]
    assert await claimer.claim(4, block_ms=10) == []  # a worker that keeps every slot for live work
    # Taken batch jobs are pending under this worker's lease, like any lane's.
    assert (await redis.xpending(claimer.batch, contract.POOL_GROUP))["pending"] == 3


async def test_a_live_request_admitted_while_a_batch_runs_is_claimed_before_its_remaining_lines(redis) -> None:
    await redis.set(EPOCH_KEY, 1)
    claimer = Claimer(redis, "m", "w2")
    await claimer.setup()
    await _feed(redis, 6)
    assert len(_taken(await claimer.claim(2, block_ms=10, batch_free=2))) == 2  # the batch runs
    await _admit(redis, "live-s", Lane.STANDARD)
    await _admit(redis, "live-p", Lane.PREMIUM)
    # One free slot: the live requests come first, whatever waited on the batch lane before them.
    assert _taken(await claimer.claim(1, block_ms=10, batch_free=1)) == [(Lane.PREMIUM, "live-p")]
    assert _taken(await claimer.claim(1, block_ms=10, batch_free=1)) == [(Lane.STANDARD, "live-s")]
    for i in range(3):
        await _admit(redis, f"s{i}", Lane.STANDARD)
    # Free slots left over (the standard lane may fill only two) while live jobs still wait: no batch
    # line takes them.
    assert _taken(await claimer.claim(4, block_ms=10, standard_free=2, batch_free=3)) == [
        (Lane.STANDARD, "s0"), (Lane.STANDARD, "s1")]
    # The live lanes are empty once more: the batch resumes with what is left.
    assert _taken(await claimer.claim(3, block_ms=10, batch_free=3)) == [(Lane.STANDARD, "s2"),
                                                                        (Lane.BATCH, "batch_x-2"),
                                                                        (Lane.BATCH, "batch_x-3")]


async def test_a_dead_worker_s_batch_jobs_are_taken_over(redis) -> None:
    dead, live = Claimer(redis, "m", "dead"), Claimer(redis, "m", "live")
    await dead.setup()
    await _feed(redis, 2)
    assert len(_taken(await dead.claim(2, block_ms=10, batch_free=2))) == 2
    time.sleep(0.05)
    taken = await live.take_over(4, lease_ms=10, live_workers={"live"})
    assert [(c.lane, c.reclaimed, len(c.entries)) for c in taken] == [(Lane.BATCH, True, 2)]
