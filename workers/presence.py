"""A worker's presence in its pool: the heartbeat (from engine start-up on) and cancellations."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import ModelFacts, WorkerInfo, WorkerState
from flatfare.redis_conn import REDIS_DOWN, stop_if_cancelled

log = logging.getLogger("flatfare.worker")

# Pause before trying Redis again after it failed.
RETRY_S = 0.5
# How long stop() lets a heartbeat under way finish before it cancels it.
STOP_WAIT_S = 5.0


def now_ms() -> int:
    return int(time.time() * 1000)


def queue_beat(pipe: Any, info: WorkerInfo, now: int) -> None:
    """One heartbeat's commands on a pipeline (asyncio or not: a starting worker beats from a thread,
    :mod:`flatfare.workers.phases`)."""
    pool = info.pool or info.model
    pipe.hset(contract.worker_key(info.worker_id), mapping=info.to_fields())
    pipe.expire(contract.worker_key(info.worker_id), int(contract.WORKER_TTL_S * 2))
    pipe.zadd(contract.pool_key(pool), {info.worker_id: now})
    pipe.zremrangebyscore(contract.pool_key(pool), "-inf", now - int(contract.WORKER_TTL_S * 4000))
    pipe.sadd(contract.POOLS_KEY, pool)


class Presence:
    """Heartbeats ``info`` every second; ``refresh`` updates its live fields just before each beat."""

    def __init__(self, redis: aioredis.Redis, info: WorkerInfo) -> None:
        self.redis = redis
        self.info = info
        self.refresh: Callable[[WorkerInfo], None] = lambda _info: None
        self._task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        # Set by stop() and soon(): the next beat goes now, not at the next second.
        self._next = asyncio.Event()

    @property
    def pool(self) -> str:
        return self.info.pool or self.info.model

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat(), name="heartbeat")

    async def beat_now(self) -> None:
        self.refresh(self.info)
        async with self.redis.pipeline(transaction=False) as pipe:
            queue_beat(pipe, self.info, now_ms())
            await pipe.execute()

    async def record_facts(self, facts: ModelFacts) -> None:
        """What this start or wake took, for gateways and fleets to say how long a cold model takes
        (only the fields measured: a wake leaves the start time as it was)."""
        await self.redis.hset(contract.model_facts_key(self.info.model), mapping=facts.to_fields())

    async def set_state(self, state: WorkerState) -> None:
        self.info.state = state
        with contextlib.suppress(*REDIS_DOWN):
            await self.beat_now()

    async def _beat(self) -> None:
        # Stopped by an event, not by cancelling: redis-py can turn a cancellation in the middle of a
        # command into a ConnectionError, which this loop retries, and the heartbeat then outlives stop().
        while not self._stopped.is_set():
            self._next.clear()  # a soon() while this beat is under way asks for another
            try:
                await self.beat_now()
            except REDIS_DOWN:
                stop_if_cancelled()
                log.warning("heartbeat failed; retrying", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._next.wait(), contract.HEARTBEAT_INTERVAL_S)

    def soon(self) -> None:
        """Beat now rather than at the next second: the worker just finished its last job, and its fleet
        waits to see it idle before it may put this engine to sleep for another model (a wake's latency)."""
        self._next.set()

    async def live_workers(self) -> set[str]:
        oldest = now_ms() - int(contract.WORKER_TTL_S * 1000)
        return {w.decode() for w in await self.redis.zrangebyscore(contract.pool_key(self.pool), oldest, "+inf")}

    async def stop(self) -> None:
        self._stopped.set()
        self._next.set()
        if self._task is not None:
            # A beat under way finishes; one stuck on an unanswering Redis is cancelled.
            _, stuck = await asyncio.wait([self._task], timeout=STOP_WAIT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(contract.pool_key(self.pool), self.info.worker_id)
                pipe.delete(contract.worker_key(self.info.worker_id))
                await pipe.execute()


async def listen_for_cancels(redis: aioredis.Redis, on_cancel: Callable[[str], None]) -> None:
    """Call ``on_cancel(request_id)`` for every cancellation a gateway publishes; subscribes again
    after Redis comes back (a cancellation published meanwhile is still seen: the cancel key the
    worker checks before it runs a job)."""
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(contract.CANCEL_CHANNEL)
            async for message in pubsub.listen():
                data = message["data"]
                on_cancel(data.decode() if isinstance(data, bytes) else data)
        except REDIS_DOWN as exc:
            stop_if_cancelled()
            log.warning("cancellations: %s; subscribing again", exc.__class__.__name__)
            await asyncio.sleep(RETRY_S)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
