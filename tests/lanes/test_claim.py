"""The claim pass (flatfare.lanes.claim) against a real redis-server, fed by the lane queue's own admission
(flatfare.lanes.admit) and batch feed (flatfare.lanes.feed): the live lanes first, batch jobs only with
slots beyond the live reserve and only while neither live lane has a job waiting, so a live request
admitted while a batch runs is claimed before the batch's remaining lines."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.lanes.admit import QuotaClaim, Verdict, admit
from flatfare.lanes.claim import ClaimKeys, Claimed, claim_pass
from flatfare.lanes.feed import feed

POOL = "m"


async def _admit(redis, request_id: str, lane: Lane) -> None:
    window = quota_window("UTC", datetime.now(UTC))
    job = Job(request_id, Endpoint.CHAT, "{}", 0, lane=lane, account_id=1)
    claim = QuotaClaim(1, window.day, None, expiry(window.resets_at), inflight_expires_ms=int(time.time() * 1000) + 60_000)
    answer = await admit(redis, job, POOL, claim, holder=contract.held_units("g"), held=f"1:{window.day}",
                         max_depth=1000)
    assert answer.verdict is Verdict.ADMITTED


async def _feed(redis, count: int) -> None:
    """Batch lines as the dispatcher queues them: straight into the pool's batch lane."""
    await feed(redis, {POOL: [Job(f"batch_x-{i}", Endpoint.CHAT, "{}", 0, lane=Lane.BATCH,
                                  reply_to=contract.BATCH_REPLIES) for i in range(count)]})


async def _claim(redis, worker: str, free: int, *, standard_free: int | None = None,
                 batch_free: int = 0) -> list[tuple[Lane | None, str]]:
    claimed, _ = await claim_pass(redis, ClaimKeys(POOL, worker), free=free,
                                  standard_free=free if standard_free is None else standard_free,
                                  standard_first=False, batch_free=batch_free)
    return _taken(claimed)


def _taken(claimed: list[Claimed]) -> list[tuple[Lane | None, str]]:
    return [(batch.lane, fields[b"id"].decode()) for batch in claimed for _, fields in batch.entries]


async def test_batch_jobs_fill_only_the_slots_beyond_the_live_reserve(redis) -> None:
    await _feed(redis, 5)
    assert await _claim(redis, "w1", 4, batch_free=3) == [(Lane.BATCH, f"batch_x-{i}") for i in range(3)]
    assert await _claim(redis, "w1", 4) == []  # a worker that keeps every slot for live work
    # Taken batch jobs are pending under this worker's lease, like any lane's.
    assert (await redis.xpending(contract.job_stream(POOL, Lane.BATCH), contract.POOL_GROUP))["pending"] == 3


async def test_a_live_request_admitted_while_a_batch_runs_is_claimed_before_its_remaining_lines(redis) -> None:
    await redis.set(contract.QUOTA_EPOCH_KEY, 1)
    await _feed(redis, 6)
    assert len(await _claim(redis, "w2", 2, batch_free=2)) == 2  # the batch runs
    await _admit(redis, "live-s", Lane.STANDARD)
    await _admit(redis, "live-p", Lane.PREMIUM)
    # One free slot: the live requests come first, whatever waited on the batch lane before them.
    assert await _claim(redis, "w2", 1, batch_free=1) == [(Lane.PREMIUM, "live-p")]
    assert await _claim(redis, "w2", 1, batch_free=1) == [(Lane.STANDARD, "live-s")]
    for i in range(3):
        await _admit(redis, f"s{i}", Lane.STANDARD)
    # Free slots left over (the standard lane may fill only two) while live jobs still wait: no batch
    # line takes them.
    assert await _claim(redis, "w2", 4, standard_free=2, batch_free=3) == [(Lane.STANDARD, "s0"),
                                                                          (Lane.STANDARD, "s1")]
    # The live lanes are empty once more: the batch resumes with what is left.
    assert await _claim(redis, "w2", 3, batch_free=3) == [(Lane.STANDARD, "s2"), (Lane.BATCH, "batch_x-2"),
                                                          (Lane.BATCH, "batch_x-3")]
