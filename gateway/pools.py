"""What the gateway knows of models: the SQL catalog and the live workers' heartbeats in Redis."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

import redis.asyncio as aioredis
from async_lru import alru_cache
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.capabilities import Capabilities, capabilities_of
from flatfare.contract import WorkerInfo, WorkerState
from flatfare.storage.models import CatalogModel
from flatfare.gateway.errors import APIError

# Pools whose live workers are remembered at once (clients name models, so this is bounded).
MAX_POOLS = 1024
# A pool served within this long answers 503 (no live worker) rather than 404 while it has none.
SERVED_MEMORY_S = 60.0


class ModelState(StrEnum):
    WARM = "warm"
    STARTING = "starting"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    enabled: bool
    min_workers: int
    created: int
    # Plans that may use the model; None: any plan whose own list allows it.
    plans: frozenset[str] | None = None
    # Pinned or with a minimum of workers: it should always be served.
    expected: bool = False
    # What the API offers on it, from its engine options (checked before a request is counted).
    capabilities: Capabilities = Capabilities()
    # Its engine options' max_model_len; None: the model's own (the live workers report it).
    max_model_len: int | None = None

    def allows_plan(self, plan: str) -> bool:
        return self.plans is None or plan in self.plans


@dataclass(frozen=True, slots=True)
class Pool:
    """Warm workers the gateway can route a model's requests to right now."""

    model: str
    workers: tuple[WorkerInfo, ...]
    name: str = ""  # the pool's key: the model, or model@pool for a dedicated pool

    @property
    def max_model_len(self) -> int:
        return min(w.max_model_len for w in self.workers)


class Pools:
    def __init__(self, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession], ttl_s: float) -> None:
        self._redis = redis
        self._sessions = sessions
        # Read at most once per ``ttl_s`` (per pool), by one of the requests in flight then.
        self.catalog = alru_cache(maxsize=1, ttl=ttl_s)(self._read_catalog)
        self.live_workers = alru_cache(maxsize=MAX_POOLS, ttl=ttl_s)(self._read_live_workers)
        # Pools this process saw served (monotonic seconds): one whose workers vanish at once (Redis
        # lost its data, and they have not announced themselves again yet) is unavailable, not unknown.
        self._served: dict[str, float] = {}

    async def _read_catalog(self) -> dict[str, CatalogEntry]:
        async with self._sessions() as session:
            rows = (await session.scalars(select(CatalogModel))).all()
        return {row.name: CatalogEntry(row.name, row.enabled, row.min_workers, _epoch(row.created_at),
                                       frozenset(row.plans) if row.plans is not None else None,
                                       expected=row.pinned or row.min_workers > 0,
                                       capabilities=capabilities_of(row.engine_options or {}),
                                       max_model_len=(row.engine_options or {}).get("max_model_len"))
                for row in rows}

    async def _read_live_workers(self, model: str) -> tuple[WorkerInfo, ...]:
        oldest = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        ids = await self._redis.zrangebyscore(contract.pool_key(model), oldest, "+inf")
        workers: list[WorkerInfo] = []
        if ids:
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(contract.worker_key(worker_id.decode()))
                for fields in await pipe.execute():
                    if fields:
                        workers.append(WorkerInfo.from_fields(fields))
        if workers:
            if len(self._served) >= MAX_POOLS:
                self._served.clear()
            self._served[model] = time.monotonic()
        return tuple(workers)

    async def warm_workers(self, pool: str) -> tuple[WorkerInfo, ...]:
        return tuple(w for w in await self.live_workers(pool) if w.state is WorkerState.WARM)

    async def model_states(self) -> dict[str, ModelState]:
        """What ``/v1/models`` shows: every model a shared pool serves or starts, and every enabled
        catalog model expected to be served (pinned or with a minimum of workers), by state."""
        states: dict[str, ModelState] = {}
        pools = sorted(m.decode() for m in await self._redis.smembers(contract.POOLS_KEY))
        for pool in pools:
            if "@" in pool:  # dedicated pools are not listed to everyone
                continue
            workers = await self.live_workers(pool)
            if any(w.state is WorkerState.WARM for w in workers):
                states[pool] = ModelState.WARM
            elif any(w.state is WorkerState.STARTING for w in workers):
                states[pool] = ModelState.STARTING
        for entry in (await self.catalog()).values():
            if not entry.enabled:
                states.pop(entry.name, None)
            elif entry.expected and entry.name not in states:
                states[entry.name] = ModelState.UNAVAILABLE
        return dict(sorted(states.items()))

    async def route(self, model: str, dedicated_pool: str | None = None) -> Pool:
        """The pool for ``model`` (the account's dedicated one when it has warm workers), or the
        error the client should get."""
        entry = (await self.catalog()).get(model)
        if entry is not None and not entry.enabled:
            raise APIError(404, f"The model '{model}' is disabled on this platform.", param="model",
                           code="model_not_found")
        if dedicated_pool:
            name = contract.pool_name(model, dedicated_pool)
            workers = await self.warm_workers(name)
            if workers:
                return Pool(model, workers, name)
        workers = await self.warm_workers(model)
        if workers:
            return Pool(model, workers, model)
        starting = any(w.state is WorkerState.STARTING for w in await self.live_workers(model))
        served_lately = time.monotonic() - self._served.get(model, -SERVED_MEMORY_S) < SERVED_MEMORY_S
        if entry is None and not starting and not served_lately:
            raise APIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        why = "is starting" if starting else "has no live worker"
        raise APIError(503, f"The model '{model}' {why} right now; retry shortly.", param="model",
                       code="model_unavailable", headers={"Retry-After": "5"})


def _epoch(value: datetime | None) -> int:
    return int(value.timestamp()) if value else 0
