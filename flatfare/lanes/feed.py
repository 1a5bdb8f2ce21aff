"""Batch API lines onto a pool's batch lane: straight into its stream (no accounts' queues, no quota, no
in-flight sets), only while both live lanes have nothing waiting, a few at a time. A worker's claim
pass reads the batch lane last (:mod:`.claim`).
"""

from __future__ import annotations

from flatfare import contract
from flatfare.contract import Job, Lane


async def batch_room(redis: object, pools: list[str], window: int) -> dict[str, int]:
    """How many more lines each of ``pools`` takes now: none while a job waits on either of its live
    lanes (live work comes first), else up to ``window`` batch jobs waiting or running in its batch
    lane (a job's entry goes with its acknowledgement). One round trip."""
    async with redis.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
        for pool in pools:
            for lane in contract.LIVE_LANES:
                pipe.get(contract.queued_key(pool, lane))
            pipe.xlen(contract.job_stream(pool, Lane.BATCH))
        counts = await pipe.execute()
    room: dict[str, int] = {}
    for i, pool in enumerate(pools):
        premium, standard, batch_jobs = counts[3 * i:3 * i + 3]
        live_waiting = int(premium or 0) > 0 or int(standard or 0) > 0
        room[pool] = 0 if live_waiting else max(window - int(batch_jobs), 0)
    return room


async def feed(redis: object, lines: dict[str, list[Job]]) -> None:
    """Each pool's jobs onto its batch lane, and its wake stream rung (idle workers block on it)."""
    async with redis.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
        for pool, jobs in lines.items():
            for job in jobs:
                pipe.xadd(contract.job_stream(pool, Lane.BATCH), job.to_fields())
            pipe.xadd(contract.wake_stream(pool), {"j": 1}, maxlen=64, approximate=True)
        await pipe.execute()
