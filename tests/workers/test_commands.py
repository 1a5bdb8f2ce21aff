"""A fleet's commands to a worker (contract item 8), on the worker loop with the instant engine (which
sleeps and wakes as a GPU engine does) against a real redis-server: SLEEP stops claiming, lets the running
job finish, puts the engine to sleep and heartbeats ``asleep``; a job queued meanwhile waits for WAKE,
after which the worker is warm, answers it and records the wake time; STOP drains and ends the loop
(however old it is); an engine that cannot sleep refuses; a stale SLEEP or WAKE is ignored."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Command, CommandKind, ModelFacts, ReplyKind, WorkerInfo, WorkerState
from flatfare.workers.instant import InstantEngine
from flatfare.workers.presence import now_ms
from tests.workers.test_loop import CHAT, POOL, _answered, _eventually, _job, _queue, _replies, start_worker

__all__ = ["start_worker"]  # the fixture, shared with the loop's tests


async def _send(redis: aioredis.Redis, kind: CommandKind, level: int = 1, worker_id: str = "w1",
                issued_ms: int | None = None) -> None:
    command = Command(kind, level, now_ms() if issued_ms is None else issued_ms)
    await redis.rpush(contract.worker_commands(worker_id), command.encode())


async def _info(redis: aioredis.Redis, worker_id: str = "w1") -> WorkerInfo | None:
    fields = await redis.hgetall(contract.worker_key(worker_id))
    return WorkerInfo.from_fields(fields) if fields else None


async def _in_state(redis: aioredis.Redis, state: WorkerState) -> WorkerInfo:
    async def reached() -> WorkerInfo | None:
        info = await _info(redis)
        return info if info is not None and info.state is state else None

    return await _eventually(reached)


async def test_sleep_finishes_the_running_job_then_sleeps_and_a_queued_job_waits_for_wake(redis, start_worker) -> None:
    engine = InstantEngine(tokens=3, first_token_delay_s=0.5, sleep_delay_s=0.2, wake_delay_s=0.3)
    worker = await start_worker(engine)
    await _queue(redis, _job("running", CHAT))
    await _eventually(lambda: _running(worker))
    await _send(redis, CommandKind.SLEEP, level=2)
    await _in_state(redis, WorkerState.SLEEPING)
    [reply] = await _answered(redis, "running")  # finished, not cut off by the sleep
    assert reply.kind is ReplyKind.RESPONSE
    info = await _in_state(redis, WorkerState.ASLEEP)
    assert engine.asleep_level == 2 and info.extra["sleep_level"] == 2
    assert info.last_used_ms >= reply.started_ms  # set when the job was taken and when it finished

    await _queue(redis, _job("queued", CHAT))
    await _send(redis, CommandKind.SLEEP)  # asleep already: ignored
    # Asleep, it claims nothing: the job stays queued (the instant engine fails any run while asleep).
    await asyncio.sleep(1.5)
    assert await _replies(redis, "queued") == []
    assert int(await redis.get(contract.queued_key(POOL, contract.Lane.STANDARD)) or 0) == 1

    await _send(redis, CommandKind.WAKE)
    [reply] = await _answered(redis, "queued")
    assert reply.kind is ReplyKind.RESPONSE
    info = await _in_state(redis, WorkerState.WARM)
    assert "sleep_level" not in info.extra and engine.asleep_level == 0
    facts = ModelFacts.from_fields(await redis.hgetall(contract.model_facts_key(POOL)))
    assert facts.wake_s >= engine.wake_delay_s  # measured around the engine's wake


async def _running(worker: Any) -> bool:
    return bool(worker.loop.inflight)


async def test_stop_drains_and_ends_the_worker_even_asleep(redis, start_worker) -> None:
    worker = await start_worker()
    await _send(redis, CommandKind.SLEEP)
    await _in_state(redis, WorkerState.ASLEEP)
    await _send(redis, CommandKind.STOP, issued_ms=1)  # however old: obeyed
    await asyncio.wait_for(worker.task, 20)  # the loop returned: `flatfare worker` exits 0
    assert await _info(redis) is None  # deregistered
    assert await redis.zscore(contract.pool_key(POOL), "w1") is None


async def test_a_job_past_the_drain_timeout_is_handed_back_and_the_engine_sleeps(redis, start_worker) -> None:
    engine = InstantEngine(tokens=1000, token_delay_s=0.05)
    await start_worker(engine, drain_timeout_s=0.5)
    await _queue(redis, _job("long", {**CHAT, "stream": True}))
    await _eventually(lambda: _replies(redis, "long"))  # streaming
    await _send(redis, CommandKind.SLEEP)
    await _in_state(redis, WorkerState.ASLEEP)
    # Handed back (idle far past any lease): a live worker takes it over at once.
    pending = await redis.xpending_range(contract.job_stream(POOL), contract.POOL_GROUP, "-", "+", 10)
    assert [p["time_since_delivered"] > contract.DEFAULT_LEASE_S * 1000 for p in pending] == [True]


async def test_an_engine_that_cannot_sleep_refuses_and_keeps_serving(redis, start_worker) -> None:
    engine = InstantEngine(tokens=2)
    engine.sleep_unavailable = "vLLM's cpu build has no sleep mode"
    await start_worker(engine)
    await _send(redis, CommandKind.SLEEP)

    async def refused() -> WorkerInfo | None:
        info = await _info(redis)
        return info if info is not None and "sleep_refused" in info.extra else None

    info = await _eventually(refused)
    assert info.extra["sleep_refused"] == engine.sleep_unavailable and info.state is WorkerState.WARM
    await _queue(redis, _job("served", CHAT))
    [reply] = await _answered(redis, "served")
    assert reply.kind is ReplyKind.RESPONSE and engine.asleep_level == 0


async def test_a_command_issued_before_the_last_state_change_is_ignored(redis, start_worker) -> None:
    engine = InstantEngine(tokens=2)
    await start_worker(engine)
    await _send(redis, CommandKind.SLEEP)
    asleep = await _in_state(redis, WorkerState.ASLEEP)
    await _send(redis, CommandKind.WAKE, issued_ms=asleep.started_ms - 1)  # decided before the sleep
    await _send(redis, CommandKind.SLEEP, level=7)  # not a level: ignored too
    await asyncio.sleep(1.0)
    assert (await _info(redis)).state is WorkerState.ASLEEP and engine.asleep_level == 1
    await _send(redis, CommandKind.WAKE)
    await _in_state(redis, WorkerState.WARM)


async def test_a_sleep_rings_the_pools_wake_stream_so_a_blocked_claim_lets_it_through(redis, start_worker) -> None:
    """An idle worker's claim blocks on the pool's wake stream for up to a second, and the pause waits for
    the claim: the sleep rings the stream (as an admission does) instead of waiting that second out,
    which a wake through a fleet (put another engine to sleep, then wake this one) pays twice."""
    await start_worker(InstantEngine(tokens=1))
    await _in_state(redis, WorkerState.WARM)
    await _send(redis, CommandKind.SLEEP)
    await _in_state(redis, WorkerState.ASLEEP)
    rung = [fields for _, fields in await redis.xrange(contract.wake_stream(POOL))]
    assert {b"p": b"1"} in rung
