"""What a fleet supervisor tells its worker (contract item 8): sleep, wake, stop.

The worker BLPOPs ``worker_commands(worker_id)`` and obeys one command at a time:

- SLEEP(level): state SLEEPING, no more claims, the jobs it holds finish (within the drain timeout;
  the rest are handed back), the engine sleeps (vLLM sleep mode), state ASLEEP. An engine that cannot
  sleep (vLLM's CPU build, or one started without sleep mode) refuses: it stays WARM, logs why and
  heartbeats the reason in ``extra["sleep_refused"]``; its fleet stops it instead.
- WAKE: state WAKING, the engine wakes (and reloads its weights after a level-2 sleep), state WARM,
  claims again; the time it took is recorded as the model's ``ModelFacts.wake_s``.
- STOP: the same drain as SIGTERM, then the process exits 0.

A SLEEP or WAKE issued before the worker's last state change is stale (the fleet decided on old news)
and ignored, as is one that does not fit the state (WAKE while warm, SLEEP while asleep). STOP is always
obeyed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Command, CommandKind, ModelFacts, WorkerInfo, WorkerState
from flatfare.redis_conn import REDIS_DOWN, stop_if_cancelled
from flatfare.workers.presence import RETRY_S, Presence, now_ms

log = logging.getLogger("flatfare.worker")

# BLPOP's wait: well inside the client's socket timeout (flatfare.redis_conn.SOCKET_TIMEOUT_S).
BLOCK_S = 2
SLEEP_LEVELS = (1, 2)


class SleepingEngine(Protocol):
    # Why this engine cannot sleep ("" when it can).
    sleep_unavailable: str

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, level: int) -> None: ...


class Obeying(Protocol):
    """The worker loop as commands drive it (:class:`flatfare.workers.loop.WorkerLoop`)."""

    info: WorkerInfo
    presence: Presence

    async def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...


class Commands:
    def __init__(self, redis: aioredis.Redis, worker: Obeying, engine: SleepingEngine) -> None:
        self.redis = redis
        self.worker = worker
        self.engine = engine
        self.key = contract.worker_commands(worker.info.worker_id)
        # The level the engine sleeps at (0: awake), and when the state last changed (ms).
        self.level = 0
        self.changed_ms = now_ms()

    async def follow(self) -> None:
        while True:
            try:
                item = await self.redis.blpop([self.key], timeout=BLOCK_S)
            except REDIS_DOWN as exc:
                stop_if_cancelled()
                log.warning("reading commands failed (%s); retrying", exc.__class__.__name__)
                await asyncio.sleep(RETRY_S)
                continue
            if item is None:
                continue
            try:
                command = Command.decode(item[1])
            except (ValueError, KeyError, TypeError):
                log.error("ignoring a malformed command %r", item[1])
                continue
            await self.obey(command)

    async def obey(self, command: Command) -> None:
        state = self.worker.info.state
        # A stop is never stale: the fleet counts the engine as gone once it said so.
        if command.kind is not CommandKind.STOP and command.issued_ms and command.issued_ms < self.changed_ms:
            log.info("ignoring %s issued at %d: the worker became %s after it", command.kind.value,
                     command.issued_ms, state.value)
            return
        if command.kind is CommandKind.STOP:
            log.info("stopping: told so by fleet %s", self.worker.info.fleet or "(none)")
            self.worker.stop()
        elif command.kind is CommandKind.SLEEP:
            if state is not WorkerState.WARM:
                log.info("ignoring sleep: the worker is %s", state.value)
            elif command.level not in SLEEP_LEVELS:
                log.error("ignoring sleep at level %d: vLLM sleeps at level 1 or 2", command.level)
            else:
                await self._sleep(command.level)
        elif state is WorkerState.ASLEEP:
            await self._wake()
        else:
            log.info("ignoring wake: the worker is %s", state.value)

    async def _sleep(self, level: int) -> None:
        info = self.worker.info
        if self.engine.sleep_unavailable:
            log.warning("refusing to sleep: %s; stop this worker instead (a stop command)",
                        self.engine.sleep_unavailable)
            info.extra["sleep_refused"] = self.engine.sleep_unavailable
            return
        self.changed_ms = now_ms()
        await self.worker.presence.set_state(WorkerState.SLEEPING)
        await self.worker.pause()
        began = time.monotonic()
        try:
            await self.engine.sleep(level)
        except Exception:  # noqa: BLE001 - an engine in an unknown state must not serve again
            log.exception("the engine failed to go to sleep; stopping this worker")
            self.worker.stop()
            return
        self.level = level
        info.extra["sleep_level"] = level
        self.changed_ms = now_ms()
        await self.worker.presence.set_state(WorkerState.ASLEEP)
        log.info("asleep at level %d (%.2f s to sleep)", level, time.monotonic() - began)

    async def _wake(self) -> None:
        info = self.worker.info
        self.changed_ms = now_ms()
        await self.worker.presence.set_state(WorkerState.WAKING)
        began = time.monotonic()
        try:
            await self.engine.wake_up(self.level)
        except Exception:  # noqa: BLE001 - as above: exit, so the fleet starts a fresh engine
            log.exception("the engine failed to wake up; stopping this worker")
            self.worker.stop()
            return
        wake_s = time.monotonic() - began
        self.level = 0
        info.extra.pop("sleep_level", None)
        self.changed_ms = now_ms()
        self.worker.resume()
        await self.worker.presence.set_state(WorkerState.WARM)
        log.info("awake again in %.2f s", wake_s)
        try:
            await self.worker.presence.record_facts(ModelFacts(wake_s=round(wake_s, 3)))
        except REDIS_DOWN:
            log.warning("could not record the wake time of %s", info.model)
