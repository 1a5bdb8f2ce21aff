"""``flatfare fleet``: one host's supervisor of worker processes (contract item 8).

Every tick it reads the catalog (every few seconds), the queued demand of each model it serves, its
children's heartbeats and the other live workers of those pools, asks :func:`flatfare.fleet.decisions.decide`
what to do, and does it: start a worker process, tell one to sleep or wake (a :class:`Command` on its
list), or stop one (SIGTERM: it drains, then exits). Every second it publishes its
:class:`FleetStatus`. A child that exits untold is a failed start (or a crash): the plan retries it
with backoff, and only while its model still needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.contract import Command, CommandKind, FleetStatus, Lane, WorkerInfo, WorkerState
from flatfare.contract.timing import FLEET_STATUS_EVERY_S
from flatfare.fleet.children import Child, Told, last_line, log_name, spawn
from flatfare.fleet.metrics import FleetMetrics
from flatfare.fleet.decisions import HOLDING, Act, Action, Budget, Engine, Failure, FleetModel, Plan, decide
from flatfare.fleet.settings import FleetSettings
from flatfare.fleet.weights import weights_gb
from flatfare.lanes.depth import pool_queues
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import CatalogModel

log = logging.getLogger("flatfare.fleet")

# The catalog is read at most this often: an edit reaches the fleet within it.
CATALOG_EVERY_S = 2.0
DECISIONS_KEPT = 50
# A command a worker has not taken by then is dropped with its list.
COMMANDS_TTL_S = 60


class FleetRunning(Exception):
    """Another fleet with this id is running: two would fight over the same workers."""


def now_ms() -> int:
    return int(time.time() * 1000)


class Supervisor:
    def __init__(self, settings: FleetSettings, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession],
                 metrics: FleetMetrics | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.sessions = sessions
        self.metrics = metrics or FleetMetrics()
        self.budget: Budget = settings.budget()
        self.tick_s = settings.tick_s(self.budget.gpu)
        self.logs = settings.data_dir / "logs"
        self.children: dict[str, Child] = {}
        self.models: dict[str, FleetModel] = {}
        # Every model a request may name that this fleet serves: its models and their LoRA variants.
        self.served: list[str] = []
        self.failures: dict[str, Failure] = {}
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        self.waiting: dict[str, str] = {}
        self.demand: dict[str, int] = {}
        self.batch_demand: dict[str, int] = {}
        # Models of fleet_preload not yet warm once: they count as asked for until then.
        self.preload = set(settings.fleet_preload)
        self._started: dict[str, int] = {}
        # Workers of an earlier run of this fleet (same id) told to stop.
        self.orphans: set[str] = set()
        self._catalog_at = 0.0
        self._status_at = 0.0

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        if await self.redis.exists(contract.fleet_key(self.settings.fleet_id)):
            raise FleetRunning(f"fleet {self.settings.fleet_id!r} is running already (its status is in Redis); "
                               "give this one another FLATFARE_FLEET_ID, or stop that one (a fleet that died "
                               f"leaves its status for {contract.FLEET_TTL_S} s)")
        log.info("fleet %s: slots %s (%s), at most %d awake, %.1f GiB of host memory for sleepers, a decision "
                 "every %g s", self.settings.fleet_id, ",".join(self.budget.slots), "gpu" if self.budget.gpu else "cpu",
                 self.budget.max_awake, self.budget.host_memory_gb, self.tick_s)
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except (*REDIS_DOWN, *DATABASE_DOWN) as exc:
                    log.warning("fleet tick failed (%s: %s); trying again", exc.__class__.__name__, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.tick_s)
        finally:
            await self.shutdown()

    async def tick(self) -> Plan:
        if time.monotonic() - self._catalog_at >= CATALOG_EVERY_S:
            await self.read_catalog()
            self._catalog_at = time.monotonic()
        now = now_ms()
        self.demand = await self.read_demand()
        self.batch_demand = await self.read_batch_demand()
        foreign = await self.read_heartbeats()
        await self.reap(now)
        for child in list(self.children.values()):
            refused = child.sleep_refused()
            if refused and child.told is not None and child.told.act is Act.SLEEP:
                # It cannot sleep (an engine without sleep mode): stop it instead, as the worker asks.
                self.record(Action(Act.STOP, child.model, f"it cannot sleep ({refused})", child.worker_id))
                child.told = None
                child.terminate()
        engines = [child.engine(now) for child in self.children.values()] + foreign
        for child in self.children.values():
            for event in child.events:
                self.record_event("ignored", child.model, child.worker_id, event)
            child.events.clear()
            if child.reported is WorkerState.WARM:
                self.failures.pop(child.model, None)
                self.preload.discard(child.model)
        demand = {m: q + (1 if m in self.preload else 0) for m, q in self.demand.items()}
        plan = decide(self.models, demand, engines, self.budget, now, self.failures, self.batch_demand)
        for action in plan.actions:
            await self.carry_out(action, now)
        self.waiting = self._waiting(plan, demand, now)
        holding = [c for c in self.children.values() if c.state(now) in HOLDING]
        self.metrics.observe((c.state(now) for c in self.children.values()), self.budget, len(holding),
                             len(self.waiting))
        if time.monotonic() - self._status_at >= FLEET_STATUS_EVERY_S:
            await self.publish()
            self._status_at = time.monotonic()
        return plan

    # -- what it reads ----------------------------------------------------------------------------

    async def read_catalog(self) -> None:
        async with self.sessions() as session:
            rows = list(await session.scalars(select(CatalogModel).where(CatalogModel.enabled.is_(True))))
        only = set(self.settings.fleet_models)
        models: dict[str, FleetModel] = {}
        for row in rows:
            if row.base_model or (only and row.name not in only):
                continue
            options = row.engine_options or {}
            slots = int(options.get("tensor_parallel_size") or 1) * int(options.get("pipeline_parallel_size") or 1)
            if self.budget.gpu and slots > len(self.budget.slots):
                continue
            keep = 0 if self.settings.fleet_on_demand else max(row.min_workers, 1 if row.pinned else 0)
            models[row.name] = FleetModel(
                row.name, keep=keep, idle_timeout_s=float(row.idle_timeout_s or self.settings.fleet_idle_timeout_s),
                slots=slots if self.budget.gpu else 1,
                weights_gb=weights_gb(row.source, self.settings.models_dir, self.settings.hf_home),
                gpu_share=float(options.get("gpu_memory_utilization") or 1.0))
        variants = sorted(row.name for row in rows if row.base_model in models)
        if set(models) != set(self.models):
            log.info("serving %s", ", ".join(sorted(models)) or "no model (none enabled fits this fleet)")
        self.models = models
        self.served = sorted(models) + variants

    async def read_demand(self) -> dict[str, int]:
        """What needs each model's engine (flatfare.lanes.depth: its lanes' queues, jobs taken and not finished,
        and jobs routed to its workers' own streams, an asleep or dead worker's included), a variant's
        counted in its base model's pool."""
        names = sorted(self.models)
        return {name: queues.demand for name, queues in (await pool_queues(self.redis, names, now_ms())).items()}

    async def read_batch_demand(self) -> dict[str, int]:
        """Batch API lines fed to each model's batch lane and not finished (its stream's entries: a
        worker deletes each once answered). They bring an engine up only on idle capacity."""
        names = sorted(self.models)
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.xlen(contract.job_stream(name, Lane.BATCH))
            counts = await pipe.execute()
        return {name: int(count) for name, count in zip(names, counts, strict=True) if count}

    async def read_heartbeats(self) -> list[Engine]:
        """Update each child's last heartbeat; the other live workers of the served pools, as engines."""
        oldest = now_ms() - int(contract.WORKER_TTL_S * 1000)
        pools = sorted(self.models)
        async with self.redis.pipeline(transaction=False) as pipe:
            for child in self.children.values():
                pipe.hgetall(contract.worker_key(child.worker_id))
            for pool in pools:
                pipe.zrangebyscore(contract.pool_key(pool), oldest, "+inf")
            replies = await pipe.execute()
        for child, fields in zip(list(self.children.values()), replies, strict=False):
            if fields:
                child.info = WorkerInfo.from_fields(fields)
        others = [wid.decode() for ids in replies[len(self.children):] for wid in ids
                  if wid.decode() not in self.children]
        if not others:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in others:
                pipe.hgetall(contract.worker_key(worker_id))
            infos = [WorkerInfo.from_fields(f) for f in await pipe.execute() if f]
        for orphan in (i for i in infos if i.fleet == self.settings.fleet_id and i.worker_id not in self.orphans):
            # Started by an earlier run of this fleet that died without stopping it: nobody owns it.
            self.orphans.add(orphan.worker_id)
            await self.redis.rpush(contract.worker_commands(orphan.worker_id),
                                   Command(CommandKind.STOP, issued_ms=now_ms()).encode())
            self.record_event("stop", orphan.model, orphan.worker_id,
                              "left running by an earlier run of this fleet (a stop command)")
        return [Engine(i.worker_id, i.model, i.state, inflight=i.inflight, last_used_ms=i.last_used_ms, own=False)
                for i in infos]

    async def reap(self, now: int) -> None:
        """Forget children that exited; one that exited untold failed, and its heartbeat goes with it (a
        crashed worker cannot take itself out of its pool)."""
        for worker_id, child in list(self.children.items()):
            code = child.process.poll()
            if code is None:
                continue
            del self.children[worker_id]
            if child.stopping:
                self.record_event("exited", child.model, worker_id, f"stopped (exit code {code})")
                continue
            reason = last_line(child.log_path) or f"exit code {code}"
            previous = self.failures.get(child.model)
            self.failures[child.model] = Failure((previous.count if previous else 0) + 1, now, reason)
            self.metrics.crashes.labels(child.model).inc()
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(contract.pool_key(child.model), worker_id)
                pipe.delete(contract.worker_key(worker_id))
                await pipe.execute()
            self.record_event("crashed", child.model, worker_id,
                              f"exited untold with code {code} ({reason}); log: {child.log_path}")

    # -- what it does -----------------------------------------------------------------------------

    async def carry_out(self, action: Action, now: int) -> None:
        if action.act is Act.START:
            n = self._started[action.model] = self._started.get(action.model, 0) + 1
            worker_id = f"{self.settings.fleet_id}-{action.model}-{n}-{now % 100000:05d}"
            child = spawn(worker_id, action.model, self.settings.fleet_id, action.slots, self.budget.gpu,
                          self.logs / log_name(action.model, n), now)
            self.children[worker_id] = child
            action = Action(action.act, action.model, f"{action.why}; log: {child.log_path}", worker_id,
                            action.slots)
        elif action.act is Act.STOP:
            self.children[action.worker_id].terminate()
        else:
            kind = CommandKind.SLEEP if action.act is Act.SLEEP else CommandKind.WAKE
            key = contract.worker_commands(action.worker_id)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, Command(kind, level=action.level or 1, issued_ms=now).encode())
                pipe.expire(key, COMMANDS_TTL_S)
                await pipe.execute()
            self.children[action.worker_id].told = Told(action.act, now, action.level)
        self.record(action)

    def record(self, action: Action) -> None:
        what = action.act.value + (f" (level {action.level})" if action.act is Act.SLEEP else "")
        self.record_event(what, action.model, action.worker_id, action.why)
        self.metrics.acted(action.act, action.model)

    def record_event(self, action: str, model: str, worker_id: str, why: str) -> None:
        self.decisions.append({"t": now_ms(), "action": action, "model": model, "worker_id": worker_id, "why": why})
        log.info("%s %s (%s): %s", action, model, worker_id or "-", why,
                 extra={"model": model, "worker_id": worker_id, "fleet_action": action})

    def _waiting(self, plan: Plan, demand: dict[str, int], now: int) -> dict[str, str]:
        """The plan's reasons, and for an asked-for model whose engine is on its way up, what it is doing."""
        waiting = dict(plan.waiting)
        for child in self.children.values():
            state = child.state(now)
            if demand.get(child.model) and child.model not in waiting and state in (WorkerState.STARTING,
                                                                                   WorkerState.WAKING):
                since = (now - child.started_ms) / 1000
                waiting[child.model] = f"its engine is {state.value} ({child.phase() or 'launching'}; {since:.0f} s)"
        return {m: why for m, why in waiting.items() if demand.get(m) or self.models.get(m, FleetModel(m)).keep}

    def status(self) -> FleetStatus:
        now = now_ms()
        engines = {
            child.worker_id: {"model": child.model, "state": child.state(now).value, "slots": list(child.slots),
                              "pid": child.process.pid, "last_used_ms": child.engine(now).last_used_ms,
                              "sleep_level": child.engine(now).sleep_level, "started_ms": child.started_ms,
                              "inflight": child.info.inflight if child.info else 0,
                              "phase": child.phase() if child.state(now) is WorkerState.STARTING else "",
                              "log": str(child.log_path)}
            for child in self.children.values()}
        return FleetStatus(fleet_id=self.settings.fleet_id, host=socket.gethostname(),
                           accelerator="gpu" if self.budget.gpu else "cpu", slots=list(self.budget.slots),
                           max_awake=self.budget.max_awake, host_memory_gb=self.budget.host_memory_gb,
                           tick_s=self.tick_s, models=self.served, engines=engines, waiting=self.waiting,
                           decisions=list(self.decisions), updated_ms=now)

    async def publish(self) -> None:
        status = self.status()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(contract.fleet_key(status.fleet_id), status.encode(), ex=contract.FLEET_TTL_S)
            pipe.zadd(contract.FLEETS_KEY, {status.fleet_id: status.updated_ms})
            pipe.zremrangebyscore(contract.FLEETS_KEY, "-inf", status.updated_ms - contract.FLEET_TTL_S * 1000)
            await pipe.execute()

    async def shutdown(self) -> None:
        """Stop every child (they drain), kill those still running after the stop timeout, and leave."""
        for child in self.children.values():
            child.terminate()
        deadline = time.monotonic() + self.settings.fleet_stop_timeout_s
        while any(c.process.poll() is None for c in self.children.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        for child in self.children.values():
            if child.process.poll() is None:
                log.warning("killing %s: still running %.0f s after SIGTERM", child.worker_id,
                            self.settings.fleet_stop_timeout_s)
                child.kill()
                child.process.wait()
        self.children.clear()
        with contextlib.suppress(*REDIS_DOWN):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(contract.fleet_key(self.settings.fleet_id))
                pipe.zrem(contract.FLEETS_KEY, self.settings.fleet_id)
                await pipe.execute()

