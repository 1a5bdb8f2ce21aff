"""What the gateway knows of models: the SQL catalog, the live workers' heartbeats in Redis, and the
fleet supervisors that can bring a model up on demand (``flatfare fleet``; item 8 of the contract)."""

from __future__ import annotations

import logging
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
from flatfare.contract import FleetStatus, ModelFacts, WorkerInfo, WorkerState
from flatfare.storage.models import CatalogModel
from flatfare.gateway.errors import APIError

log = logging.getLogger("flatfare.gateway")

# ``route``'s default: the catalog entry is read there.
_READ = object()
# Pools whose live workers are remembered at once (clients name models, so this is bounded).
MAX_POOLS = 1024
# A pool served within this long answers 503 (no live worker) rather than 404 while it has none.
SERVED_MEMORY_S = 60.0


class ModelState(StrEnum):
    WARM = "warm"
    WAKING = "waking"
    STARTING = "starting"
    # Its engine sleeps (or is going to sleep): a request wakes it.
    ASLEEP = "asleep"
    # No engine at all, but a fleet supervisor (or an external scaler) starts one when a request comes.
    COLD = "cold"
    UNAVAILABLE = "unavailable"


# A pool's state from its live workers' states, the first found of these: what serves soonest first.
_POOL_STATES = ((WorkerState.WARM, ModelState.WARM), (WorkerState.WAKING, ModelState.WAKING),
                (WorkerState.STARTING, ModelState.STARTING), (WorkerState.ASLEEP, ModelState.ASLEEP),
                (WorkerState.SLEEPING, ModelState.ASLEEP))
# Workers that are not warm but will be without a new engine's start being decided: a request for
# their pool is admitted and waits for them.
_COMING = frozenset({WorkerState.STARTING, WorkerState.WAKING, WorkerState.ASLEEP, WorkerState.SLEEPING})


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
    # What the API offers on it, from its engine options (checked before a request is counted); a
    # LoRA variant's are its base model's, whose engines serve it.
    capabilities: Capabilities = Capabilities()
    # Its engine options' max_model_len; None: the model's own (the live workers report it).
    max_model_len: int | None = None
    # A LoRA variant's base model (whose pool serves it); None for a model of its own.
    base_model: str | None = None

    @property
    def pool(self) -> str:
        """The shared pool whose workers serve it: its own, or its base model's for a variant."""
        return self.base_model or self.name

    def allows_plan(self, plan: str) -> bool:
        return self.plans is None or plan in self.plans


@dataclass(frozen=True, slots=True)
class Pool:
    """Where a request goes: the warm workers the gateway can route it to right now, or none (``cold``)
    when it is admitted to wait for one that a fleet, a scaler or a waking engine brings up."""

    model: str  # the model the request names (a variant keeps its own name in the job's body)
    workers: tuple[WorkerInfo, ...]
    name: str = ""  # the pool's key: the model (its base's for a variant), or model@pool for a dedicated pool
    cold: bool = False
    # A cold pool's context length, from the catalog or the last engine's start (None: unknown).
    cold_max_model_len: int | None = None

    @property
    def max_model_len(self) -> int | None:
        """The context its requests must fit; None: unknown until an engine is up (vLLM checks then)."""
        if self.workers:
            return min(w.max_model_len for w in self.workers)
        return self.cold_max_model_len


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """A model's line on ``/v1/models``: its state, and for an asleep or cold model the seconds its
    last wake or start took (None: never measured)."""

    state: ModelState
    expected_ready_s: float | None = None


class Pools:
    def __init__(self, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession], ttl_s: float,
                 external_scaler: bool = False) -> None:
        self._redis = redis
        self._sessions = sessions
        # Something outside Flatfare (KEDA) starts workers for queued requests: every enabled catalog
        # model can be brought up, so a request for one with no worker is admitted and waits.
        self._external_scaler = external_scaler
        # Read at most once per ``ttl_s`` (per pool), by one of the requests in flight then.
        self.catalog = alru_cache(maxsize=1, ttl=ttl_s)(self._read_catalog)
        self.live_workers = alru_cache(maxsize=MAX_POOLS, ttl=ttl_s)(self._read_live_workers)
        self.fleets = alru_cache(maxsize=1, ttl=ttl_s)(self._read_fleets)
        self.facts = alru_cache(maxsize=MAX_POOLS, ttl=ttl_s)(self._read_facts)
        # Pools this process saw served (monotonic seconds): one whose workers vanish at once (Redis
        # lost its data, and they have not announced themselves again yet) is unavailable, not unknown.
        self._served: dict[str, float] = {}

    async def _read_catalog(self) -> dict[str, CatalogEntry]:
        async with self._sessions() as session:
            rows = {row.name: row for row in (await session.scalars(select(CatalogModel))).all()}
        entries = {}
        for row in rows.values():
            engine_row, enabled = row, row.enabled
            if row.base_model:  # a variant is served by its base's engines: usable only while they are
                base = rows.get(row.base_model)
                enabled = enabled and base is not None and base.enabled and not base.base_model
                engine_row = base or row
            options = engine_row.engine_options or {}
            entries[row.name] = CatalogEntry(
                row.name, enabled, row.min_workers, _epoch(row.created_at),
                frozenset(row.plans) if row.plans is not None else None,
                expected=row.pinned or row.min_workers > 0, capabilities=capabilities_of(options),
                max_model_len=options.get("max_model_len"), base_model=row.base_model)
        return entries

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

    async def _read_fleets(self) -> tuple[FleetStatus, ...]:
        """The fleet supervisors heartbeating now, each as it last described itself."""
        oldest = int(time.time() * 1000 - contract.FLEET_TTL_S * 1000)
        ids = await self._redis.zrangebyscore(contract.FLEETS_KEY, oldest, "+inf")
        if not ids:
            return ()
        async with self._redis.pipeline(transaction=False) as pipe:
            for fleet_id in ids:
                pipe.get(contract.fleet_key(fleet_id.decode()))
            raws = await pipe.execute()
        fleets = []
        for fleet_id, raw in zip(ids, raws, strict=True):
            if raw is None:  # its status expired between the two reads: it is gone
                continue
            try:
                fleets.append(FleetStatus.decode(raw))
            except (ValueError, TypeError) as exc:  # a fleet of another release: it cannot be read, so not counted on
                log.warning("fleet %s's status cannot be read (%s); its models are not admitted cold",
                            fleet_id.decode(), exc)
        return tuple(fleets)

    async def _read_facts(self, pool: str) -> ModelFacts:
        return ModelFacts.from_fields(await self._redis.hgetall(contract.model_facts_key(pool)))

    async def warm_workers(self, pool: str) -> tuple[WorkerInfo, ...]:
        return tuple(w for w in await self.live_workers(pool) if w.state is WorkerState.WARM)

    async def startable(self, entry: CatalogEntry) -> bool:
        """Someone brings ``entry``'s engines up when a request is queued for it: a live fleet lists
        it (or its base), or an external scaler sizes every pool."""
        if self._external_scaler:
            return True
        return any(entry.name in fleet.models or entry.pool in fleet.models for fleet in await self.fleets())

    async def cold_start_reason(self, model: str, pool: str) -> str | None:
        """Why no engine of ``model`` (served by ``pool``) came up, as a fleet that wants to start it says."""
        for fleet in await self.fleets():
            if why := fleet.waiting.get(pool) or fleet.waiting.get(model):
                return why
        return None

    async def context_length(self, entry: CatalogEntry | None, model: str) -> int | None:
        """``model``'s context: its live engines' (asleep ones included), else its catalog entry's, else
        what its last engine reported (None: never known)."""
        pool = entry.pool if entry is not None else model
        reported = [w.max_model_len for w in await self.live_workers(pool) if w.max_model_len]
        if reported:
            return min(reported)
        if entry is not None and entry.max_model_len:
            return entry.max_model_len
        return (await self.facts(pool)).max_model_len or None

    async def model_states(self) -> dict[str, ModelStatus]:
        """What ``/v1/models`` shows: every model a shared pool serves, starts, wakes or keeps asleep,
        every enabled catalog model that can be brought up on demand (cold), the variants of each, and
        every enabled catalog model expected to be served (pinned or with a minimum of workers) that
        is none of these (unavailable)."""
        states: dict[str, ModelStatus] = {}
        pools = sorted(m.decode() for m in await self._redis.smembers(contract.POOLS_KEY))
        for pool in pools:
            if "@" in pool:  # dedicated pools are not listed to everyone
                continue
            workers = await self.live_workers(pool)
            found = {w.state for w in workers}
            state = next((model_state for worker_state, model_state in _POOL_STATES if worker_state in found), None)
            if state is not None:
                wake_s = (await self.facts(pool)).wake_s if state is ModelState.ASLEEP else 0.0
                states[pool] = ModelStatus(state, wake_s or None)
        catalog = await self.catalog()
        # Models of their own first: a variant takes its base's state.
        for entry in sorted(catalog.values(), key=lambda e: e.base_model is not None):
            if not entry.enabled:
                states.pop(entry.name, None)
            elif entry.base_model and entry.base_model in states:
                states[entry.name] = states[entry.base_model]
            elif entry.name in states:
                continue
            elif await self.startable(entry):
                states[entry.name] = ModelStatus(ModelState.COLD, (await self.facts(entry.pool)).start_s or None)
            elif entry.expected:
                states[entry.name] = ModelStatus(ModelState.UNAVAILABLE)
        return dict(sorted(states.items()))

    async def route(self, model: str, dedicated_pool: str | None = None, *, entry: CatalogEntry | None | object = _READ,
                    wait: bool = False) -> Pool:
        """The pool for ``model`` (the account's dedicated one when it has warm workers), a cold pool
        when none is warm but one can be brought up, or the error the client should get. ``entry``:
        the model's catalog entry as the caller read it (None: not in the catalog); read here if not
        given. ``wait``: a request that can wait for its pool (a batch line) gets a cold pool where a
        live one would be refused 503; only an unknown or disabled model is refused (404)."""
        if entry is _READ:
            entry = (await self.catalog()).get(model)
        assert entry is None or isinstance(entry, CatalogEntry)
        if entry is not None and not entry.enabled:
            raise APIError(404, f"The model '{model}' is disabled on this platform.", param="model",
                           code="model_not_found")
        shared = entry.pool if entry is not None else model
        if dedicated_pool:
            name = contract.pool_name(shared, dedicated_pool)
            workers = await self.warm_workers(name)
            if workers:
                return Pool(model, workers, name)
        live = await self.live_workers(shared)
        workers = tuple(w for w in live if w.state is WorkerState.WARM)
        if workers:
            return Pool(model, workers, shared)
        # An engine starting, waking or asleep comes up (a catalog model or not, as the worker started
        # by hand that serves a model of its own name); a catalog model also when someone starts one.
        served_lately = time.monotonic() - self._served.get(shared, -SERVED_MEMORY_S) < SERVED_MEMORY_S
        if any(w.state in _COMING for w in live) or (entry is not None and (wait or await self.startable(entry))) \
                or (wait and served_lately):
            return Pool(model, (), shared, cold=True, cold_max_model_len=await self.context_length(entry, model))
        if entry is None and not served_lately:
            raise APIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        if entry is not None:
            why = ("has no live worker and no fleet supervisor serves it; retry later (operators: start "
                   "`flatfare fleet` on a host that can run it, or a worker of it).")
        else:
            why = "has no live worker right now; retry shortly."
        raise APIError(503, f"The model '{model}' {why}", param="model", code="model_unavailable",
                       headers={"Retry-After": "5"})


def _epoch(value: datetime | None) -> int:
    return int(value.timestamp()) if value else 0
