"""A pool's queues and demand as /metrics reads them (flatfare/lanes/depth.py ``pool_queues``), on a real
redis-server: jobs go in through the admission script and are taken by the workers' own claim script,
so every place a job can wait or run is where production puts it."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.lanes.depth import pool_queues
from flatfare.gateway.jobpath.queueing import Admitted, LaneLimits, LaneQueue, QuotaClaim
from flatfare.workers.claims import Claimer

POOL = "m"


@pytest.fixture
async def queue(redis) -> LaneQueue:
    await redis.set(EPOCH_KEY, 1)  # the quota counters are trusted
    return LaneQueue(redis, {lane: LaneLimits(1000, 60.0) for lane in Lane})


async def _admit(queue: LaneQueue, request_id: str, lane: Lane, account: int, stream: str | None = None) -> Admitted:
    window = quota_window("UTC", datetime.now(UTC))
    job = Job(request_id=request_id, endpoint=Endpoint.CHAT, body="{}", enqueued_ms=int(time.time() * 1000),
              lane=lane, account_id=account)
    return await queue.admit(job, POOL, QuotaClaim(account, window.day, None, expiry(window.resets_at)), stream)


async def _now_ms(redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_demand_counts_every_waiting_and_taken_job_of_the_pool(redis, queue: LaneQueue) -> None:
    # Two workers have heartbeated: w1 is live and reads its own stream; w2 died with a routed job unread.
    for worker in ("w1", "w2"):
        await redis.zadd(contract.pool_key(POOL), {worker: await _now_ms(redis)})
    w1 = Claimer(redis, POOL, "w1")
    await w1.setup()
    await Claimer(redis, POOL, "w2").setup()
    for i, account in enumerate((1, 1, 2)):
        await _admit(queue, f"s{i}", Lane.STANDARD, account)
    await _admit(queue, "p0", Lane.PREMIUM, 3)
    for i in range(2):
        await _admit(queue, f"own{i}", Lane.STANDARD, 4, stream=contract.worker_stream(POOL, "w1"))
    await _admit(queue, "stranded", Lane.STANDARD, 4, stream=contract.worker_stream(POOL, "w2"))
    # w1 takes three: its own stream's two first, then the premium job (the claim script's order).
    taken = await w1.claim(3, block_ms=0)
    assert sorted(len(c.entries) for c in taken) == [1, 2]

    found = (await pool_queues(redis, [POOL, "idle"], await _now_ms(redis)))
    queues, idle = found[POOL], found["idle"]
    premium, standard = queues.lanes
    assert (premium.lane, premium.waiting, premium.claimed) == ("premium", 0, 1)
    assert (standard.lane, standard.waiting, standard.claimed) == ("standard", 3, 0)
    assert (queues.routed_waiting, queues.routed_taken) == (1, 2)
    assert queues.demand == 3 + 1 + 1 + 2
    assert 0 <= standard.oldest_wait_s < 60 and premium.oldest_wait_s == 0.0  # premium's one job is taken
    assert idle.demand == 0 and [q.waiting for q in idle.lanes] == [0, 0]

    # Finished jobs leave it (acknowledged and deleted, as a worker does); the rest still count.
    for claimed in taken:
        await redis.xack(claimed.stream, contract.POOL_GROUP, *(entry_id for entry_id, _ in claimed.entries))
        await redis.xdel(claimed.stream, *(entry_id for entry_id, _ in claimed.entries))
    assert (await pool_queues(redis, [POOL], await _now_ms(redis)))[POOL].demand == 3 + 1


async def test_a_dead_workers_taken_jobs_still_ask_for_a_worker(redis, queue: LaneQueue) -> None:
    """A worker that died holding jobs leaves them pending under its name: until a live worker takes
    them over they are demand, so a pool scaled to zero comes back for them."""
    await redis.zadd(contract.pool_key(POOL), {"gone": 1})
    gone = Claimer(redis, POOL, "gone")
    await gone.setup()
    await _admit(queue, "a", Lane.STANDARD, 1)
    assert len((await gone.claim(1, block_ms=0))[0].entries) == 1
    queues = (await pool_queues(redis, [POOL], await _now_ms(redis)))[POOL]
    assert [q.claimed for q in queues.lanes] == [0, 1] and queues.demand == 1


async def test_the_fleet_sees_a_job_routed_to_an_asleep_workers_stream(redis, queue: LaneQueue, tmp_path,
                                                                       monkeypatch) -> None:
    """A prefix-routed job can land in a worker's own stream just as it goes to sleep: nothing queues on
    a lane, yet the model needs its engine. The fleet's demand is the gauge's, so it wakes the model."""
    from flatfare.fleet.settings import FleetSettings
    from flatfare.fleet.supervisor import Supervisor

    await redis.zadd(contract.pool_key(POOL), {"asleep": await _now_ms(redis)})
    await Claimer(redis, POOL, "asleep").setup()
    await _admit(queue, "routed", Lane.STANDARD, 5, stream=contract.worker_stream(POOL, "asleep"))
    monkeypatch.setenv("FLATFARE_DATA_DIR", str(tmp_path))
    supervisor = Supervisor(FleetSettings(), redis, sessions=None)  # type: ignore[arg-type] - no SQL read here
    supervisor.models = {POOL: None, "idle": None}  # type: ignore[dict-item] - read_demand reads the names only
    assert await supervisor.read_demand() == {POOL: 1, "idle": 0}


async def test_the_fleet_sees_batch_lines_apart_from_live_demand(redis, queue: LaneQueue, tmp_path,
                                                                  monkeypatch) -> None:
    """Batch API lines fed to a pool's batch lane are not live demand (they must not evict anything),
    but the fleet reads them apart, to bring a model up on idle capacity."""
    from flatfare.fleet.settings import FleetSettings
    from flatfare.fleet.supervisor import Supervisor

    for line in range(3):
        job = Job(request_id=f"batch_x-{line}", endpoint=Endpoint.CHAT, body="{}",
                  enqueued_ms=int(time.time() * 1000), lane=Lane.BATCH)
        await redis.xadd(contract.job_stream(POOL, Lane.BATCH), job.to_fields())
    monkeypatch.setenv("FLATFARE_DATA_DIR", str(tmp_path))
    supervisor = Supervisor(FleetSettings(), redis, sessions=None)  # type: ignore[arg-type] - no SQL read here
    supervisor.models = {POOL: None, "idle": None}  # type: ignore[dict-item] - the names only
    assert await supervisor.read_demand() == {POOL: 0, "idle": 0}
    assert await supervisor.read_batch_demand() == {POOL: 3}
