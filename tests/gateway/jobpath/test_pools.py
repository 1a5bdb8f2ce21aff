"""Models on demand, the gateway's side: a request for an enabled catalog model with no warm worker is
admitted and waits when something can bring one up (a live fleet supervisor lists it, an external
scaler, an engine starting, waking or asleep), bounded by ``cold_start_timeout_s``; otherwise it is
refused at once. ``/v1/models`` says how each model is kept, and a LoRA variant goes to its base's pool.

``create_app`` on a real Redis and SQLite (as tests/gateway/test_asgi.py); fleets are their status
written to Redis as a fleet supervisor writes it (contract item 8); workers are the real worker loop
on the instant engine, started in this process when a test wants one to come up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
import redis.asyncio as aioredis
from sqlalchemy import select

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare.contract import Endpoint, FleetStatus, Lane, ModelFacts, WorkerInfo, WorkerState
from flatfare.gateway.app import create_app
from flatfare.gateway.jobpath.prefix_routing import prefix_hash
from flatfare.gateway.settings import GatewaySettings
from flatfare.redis_conn import connect
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import CatalogModel, RequestRecord
from flatfare.workers.instant import InstantEngine
from flatfare.workers.loop import WorkerLoop
from flatfare.workers.presence import now_ms
from tests.gateway.rig import seeded_database
from tests.gateway.test_asgi import lifespan

COLD = "ondemand-a"
BASE = "ondemand-base"
VARIANT = "ondemand-base-lora"
# The default model: pinned in the seeded catalog, on the free plan.
PINNED = "smollm2-135m-instruct"
# Long enough for every cache of the gateway (0.5 s) to see what a test changed, on a slow machine.
WAIT_S = 20.0


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


@dataclass
class Gateway:
    client: httpx.AsyncClient
    key: str
    free_key: str
    account_id: int
    database_url: str
    redis: aioredis.Redis

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def rows(self) -> list[RequestRecord]:
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session:
                return list((await session.scalars(select(RequestRecord))).all())
        finally:
            await engine.dispose()

    async def counted_today(self) -> int:
        day = quota_window("UTC", datetime.now(UTC)).day
        return int(await self.redis.get(counter_key(self.account_id, day)) or 0)

    async def queued(self, pool: str) -> int:
        return int(await self.redis.get(contract.queued_key(pool, Lane.STANDARD)) or 0)


async def add_models(database_url: str, *entries: dict[str, Any]) -> None:
    engine = create_engine(database_url)
    try:
        async with session_factory(engine)() as session:
            for entry in entries:
                session.add(CatalogModel(**{"source": "builtin:none", "engine_options": {}, **entry}))
            await session.commit()
    finally:
        await engine.dispose()


async def publish_fleet(redis: aioredis.Redis, models: list[str], waiting: dict[str, str] | None = None,
                        heartbeat_ms: int | None = None, fleet_id: str = "fleet-1") -> None:
    """A fleet supervisor's heartbeat, as ``flatfare fleet`` writes it."""
    status = FleetStatus(fleet_id=fleet_id, host="host-1", slots=["cpu"], models=models, waiting=waiting or {},
                         updated_ms=now_ms())
    await redis.set(contract.fleet_key(fleet_id), status.encode(), ex=contract.FLEET_TTL_S)
    await redis.zadd(contract.FLEETS_KEY, {fleet_id: heartbeat_ms if heartbeat_ms is not None else now_ms()})


async def heartbeat(redis: aioredis.Redis, pool: str, state: WorkerState, worker_id: str) -> None:
    """A worker's heartbeat in ``state`` (as workers/presence.py writes it), for the states an instant
    worker never reaches by itself."""
    info = WorkerInfo(worker_id=worker_id, model=pool, max_model_len=2048, capacity=8, pool=pool, engine="instant",
                      started_ms=now_ms(), state=state)
    await redis.hset(contract.worker_key(worker_id), mapping=info.to_fields())
    await redis.zadd(contract.pool_key(pool), {worker_id: now_ms()})
    await redis.sadd(contract.POOLS_KEY, pool)


@asynccontextmanager
async def worker_of(redis_url: str, pool: str, worker_id: str = "w1") -> AsyncIterator[WorkerLoop]:
    """A warm worker of ``pool`` on the instant engine, in this process, until the block ends."""
    client = connect(redis_url)
    engine = InstantEngine(tokens=3)
    loop = WorkerLoop(client, engine, WorkerInfo(worker_id=worker_id, model=pool, max_model_len=engine.max_model_len,
                                                 capacity=8, engine="instant", started_ms=now_ms(), pool=pool))
    task = asyncio.create_task(loop.run())
    try:
        yield loop
    finally:
        loop.stop()
        await asyncio.wait_for(task, 30)
        await client.aclose()


async def until(read: Any, ready: Any, what: str, timeout_s: float = WAIT_S) -> Any:
    """``await read()`` once ``ready`` holds for it, polled until ``timeout_s`` (tests/conftest.py's
    ``eventually``, for coroutines)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if ready(value):
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s; last seen {value!r}"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def open_gateway(tmp_path: Path, redis_url: str, **settings: Any) -> AsyncIterator[Gateway]:
    database_url, seeded = await seeded_database(tmp_path, {"acme": "pro", "thrifty": "free"})
    (account_id, secret), (_, free_secret) = seeded["acme"], seeded["thrifty"]
    await add_models(database_url, {"name": COLD}, {"name": BASE},
                     {"name": VARIANT, "source": "/adapters/lora", "base_model": BASE})
    app = create_app(GatewaySettings(redis_url=redis_url, database_url=database_url, data_dir=tmp_path,
                                     log_format="text", log_level="warning", **settings))
    redis = connect(redis_url)
    try:
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                                    timeout=60) as client:
            yield Gateway(client, secret, free_secret, account_id, database_url, redis)
    finally:
        await redis.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_cold_model_a_fleet_serves_is_admitted_and_answered_once_a_worker_comes_up(
        tmp_path: Path, redis_url: str, stream: bool) -> None:
    async with open_gateway(tmp_path, redis_url) as gw:
        await publish_fleet(gw.redis, [COLD])
        waiting = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(COLD, stream=stream),
                                                       headers=gw.auth))
        # Admitted and queued like any request (counted, in the ledger), with no worker anywhere.
        await until(lambda: gw.queued(COLD), lambda n: n == 1, "the cold request queued")
        assert not waiting.done()
        async with worker_of(redis_url, COLD):
            answered = await asyncio.wait_for(waiting, WAIT_S)
        assert answered.status_code == 200, answered.text
        assert int(answered.headers["x-flatfare-model-wait-ms"]) >= 0
        (row,) = await gw.rows()
        assert row.model == COLD and row.billable and row.http_status == 200
        assert await gw.counted_today() == 1
        # Once warm, a request is not a cold one: no model wait to report.
        await publish_fleet(gw.redis, [])
        async with worker_of(redis_url, COLD):
            warm = await gw.client.post("/v1/chat/completions", json=chat(COLD, stream=stream), headers=gw.auth)
        assert warm.status_code == 200 and "x-flatfare-model-wait-ms" not in warm.headers
        # One cold start, of the plan's request that waited for the engine; the warm one is not one.
        assert await cold_starts(gw, COLD, "pro") == 1


async def cold_starts(gw: Gateway, model: str, plan: str) -> float:
    scraped = (await gw.client.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(scraped) for s in f.samples
               if s.name == "flatfare_cold_start_wait_seconds_count" and s.labels == {"model": model, "plan": plan})


async def test_an_engine_waking_up_without_any_fleet_still_admits(tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url) as gw:
        await heartbeat(gw.redis, COLD, WorkerState.WAKING, "waking-1")
        waiting = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(COLD), headers=gw.auth))
        await until(lambda: gw.queued(COLD), lambda n: n == 1, "the request queued for the waking engine")
        async with worker_of(redis_url, COLD):
            answered = await asyncio.wait_for(waiting, WAIT_S)
        assert answered.status_code == 200 and "x-flatfare-model-wait-ms" in answered.headers


async def test_with_no_fleet_a_model_without_workers_is_refused_at_once_and_costs_nothing(
        tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url) as gw:
        # A fleet that lists another model, and one that listed this model but stopped heartbeating.
        await publish_fleet(gw.redis, ["another-model"])
        await publish_fleet(gw.redis, [COLD], heartbeat_ms=now_ms() - contract.FLEET_TTL_S * 1000 - 1000,
                            fleet_id="fleet-gone")
        refused = await gw.client.post("/v1/chat/completions", json=chat(COLD), headers=gw.auth)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_unavailable" and error["param"] == "model"
        assert "no fleet supervisor serves it" in error["message"] and "flatfare fleet" in error["message"]
        assert await gw.rows() == [] and await gw.counted_today() == 0 and await gw.queued(COLD) == 0


async def test_a_cold_start_that_never_comes_is_withdrawn_free_with_the_fleet_s_reason(
        tmp_path: Path, redis_url: str) -> None:
    why = "no free engine slot: 1 of 1 busy serving another-model"
    async with open_gateway(tmp_path, redis_url, cold_start_timeout_s=1.0) as gw:
        await publish_fleet(gw.redis, [COLD], waiting={COLD: why})
        refused = await gw.client.post("/v1/chat/completions", json=chat(COLD), headers=gw.auth)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_cold_start_timeout" and why in error["message"], error
        assert refused.headers["x-request-id"]
        # Free: the ledger row closed not billable, the unit given back, nothing left in flight or queued.
        (row,) = await until(gw.rows, lambda rows: len(rows) == 1 and rows[0].http_status is not None,
                             "the ledger row closed")
        assert not row.billable and row.error_code == "model_cold_start_timeout" and row.http_status == 503
        assert await until(gw.counted_today, lambda n: n == 0, "the unit given back") == 0
        assert await until(lambda: gw.redis.zcard(contract.inflight_key(gw.account_id)), lambda n: n == 0,
                           "the in-flight entry removed") == 0
        assert await gw.queued(COLD) == 0
        assert await gw.redis.exists(contract.account_queue(COLD, Lane.STANDARD, gw.account_id)) == 0
        # The withdrawn job never runs: a worker that comes up now takes the next request only.
        async with worker_of(redis_url, COLD):
            served = await gw.client.post("/v1/chat/completions", json=chat(COLD), headers=gw.auth)
        assert served.status_code == 200
        assert int(await gw.redis.get(contract.drained_key(COLD, Lane.STANDARD))) == 1


async def test_an_external_scaler_admits_every_enabled_catalog_model(tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url, external_scaler=True, cold_start_timeout_s=1.0) as gw:
        refused = await gw.client.post("/v1/chat/completions", json=chat(COLD), headers=gw.auth)
        error = refused.json()["error"]
        assert refused.status_code == 503 and error["code"] == "model_cold_start_timeout", refused.text
        assert "no fleet supervisor said why" in error["message"]
        # A model outside the catalog is not the scaler's to start.
        unknown = await gw.client.post("/v1/chat/completions", json=chat("not-in-catalog"), headers=gw.auth)
        assert unknown.status_code == 404


async def test_a_cold_model_s_context_is_checked_from_what_its_last_engine_reported(
        tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url, cold_start_timeout_s=1.0) as gw:
        await publish_fleet(gw.redis, [COLD])
        await gw.redis.hset(contract.model_facts_key(COLD), mapping=ModelFacts(max_model_len=64).to_fields())
        too_long = await gw.client.post("/v1/chat/completions", json=chat(COLD, max_tokens=100), headers=gw.auth)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens", too_long.text
        assert await gw.rows() == [] and await gw.counted_today() == 0


async def test_a_variant_goes_to_its_base_s_pool_and_keeps_its_name(tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url) as gw:
        async with worker_of(redis_url, BASE):
            await until(lambda: gw.redis.zscore(contract.pool_key(BASE), "w1"), lambda s: s is not None,
                        "the base's worker heartbeat")
            answered = await gw.client.post("/v1/chat/completions", json=chat(VARIANT), headers=gw.auth)
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == VARIANT  # the job's body named the variant
        (row,) = await gw.rows()
        assert row.model == VARIANT and row.billable
        # Cold too: a fleet that serves the base admits the variant, into the base's pool.
        await publish_fleet(gw.redis, [BASE])
        waiting = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(VARIANT), headers=gw.auth))
        await until(lambda: gw.queued(BASE), lambda n: n == 1, "the variant's request queued in the base's pool")
        async with worker_of(redis_url, BASE):
            cold = await asyncio.wait_for(waiting, WAIT_S)
        assert cold.status_code == 200 and cold.json()["model"] == VARIANT
        assert "x-flatfare-model-wait-ms" in cold.headers
        # A variant is usable only while its base is (and with no fleet, a fault shows as a 503, not a wait).
        await publish_fleet(gw.redis, [])
        engine = create_engine(gw.database_url)
        async with session_factory(engine)() as session:
            (await session.get(CatalogModel, BASE)).enabled = False
            await session.commit()
        await engine.dispose()
        disabled = await until(lambda: gw.client.post("/v1/chat/completions", json=chat(VARIANT), headers=gw.auth),
                               lambda r: r.status_code == 404, "the variant disabled with its base")
        assert disabled.json()["error"]["code"] == "model_not_found"


async def models(gw: Gateway, key: str | None = None) -> dict[str, dict[str, Any]]:
    listed = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {key or gw.key}"})
    assert listed.status_code == 200, listed.text
    return {card["id"]: card for card in listed.json()["data"]}


async def test_models_say_how_each_model_is_kept(tmp_path: Path, redis_url: str) -> None:
    async with open_gateway(tmp_path, redis_url) as gw:
        await add_models(gw.database_url, {"name": "ondemand-hidden"}, {"name": "ondemand-unmeasured"},
                         {"name": "ondemand-off", "enabled": False}, {"name": "ondemand-waking"},
                         {"name": "ondemand-starting"})
        await heartbeat(gw.redis, BASE, WorkerState.ASLEEP, "sleeper")
        await heartbeat(gw.redis, "ondemand-waking", WorkerState.WAKING, "waker")
        await heartbeat(gw.redis, "ondemand-starting", WorkerState.STARTING, "starter")
        await gw.redis.hset(contract.model_facts_key(BASE), mapping=ModelFacts(wake_s=0.8, start_s=40).to_fields())
        await gw.redis.hset(contract.model_facts_key(COLD), mapping=ModelFacts(start_s=42.0,
                                                                               max_model_len=4096).to_fields())
        await publish_fleet(gw.redis, [COLD, "ondemand-unmeasured", "ondemand-off"])
        cards = await until(lambda: models(gw), lambda c: "ondemand-starting" in c, "the models listed")
        assert cards[COLD]["state"] == "cold" and cards[COLD]["expected_ready_s"] == 42.0
        assert cards[COLD]["context_length"] == 4096
        assert cards["ondemand-unmeasured"]["state"] == "cold" and "expected_ready_s" not in cards["ondemand-unmeasured"]
        assert cards[BASE]["state"] == "asleep" and cards[BASE]["expected_ready_s"] == 0.8
        assert cards[BASE]["context_length"] == 2048  # the asleep engine's
        assert cards[VARIANT]["state"] == "asleep" and cards[VARIANT]["expected_ready_s"] == 0.8
        assert cards["ondemand-waking"]["state"] == "waking" and "expected_ready_s" not in cards["ondemand-waking"]
        assert cards["ondemand-starting"]["state"] == "starting"
        assert cards[PINNED]["state"] == "unavailable"  # pinned, and nothing serves it or can start it
        # On demand with nobody to start it: not offered. Disabled: never.
        assert "ondemand-hidden" not in cards and "ondemand-off" not in cards
        one = await gw.client.get(f"/v1/models/{COLD}", headers=gw.auth)
        assert one.status_code == 200 and one.json()["state"] == "cold"
        # The plan still decides what is listed: the free plan offers the default model only.
        assert set(await models(gw, gw.free_key)) == {PINNED}
        async with worker_of(redis_url, COLD):
            cards = await until(lambda: models(gw), lambda c: c[COLD]["state"] == "warm", "the cold model warm")
        assert "expected_ready_s" not in cards[COLD]


async def test_a_prefix_is_never_routed_to_an_engine_that_is_not_warm(tmp_path: Path, redis_url: str) -> None:
    system = {"role": "system", "content": "You answer questions about this contract. " + "clause " * 100}
    body = {"model": COLD, "messages": [system, {"role": "user", "content": "q"}], "max_tokens": 3}
    async with open_gateway(tmp_path, redis_url) as gw:
        # The prefix's last server went to sleep; another engine of the model is warm.
        await heartbeat(gw.redis, COLD, WorkerState.ASLEEP, "sleeper")
        await gw.redis.set(contract.prefix_key(COLD, prefix_hash(Endpoint.CHAT, body)), "sleeper")
        async with worker_of(redis_url, COLD):
            await until(lambda: gw.redis.zscore(contract.pool_key(COLD), "w1"), lambda s: s is not None,
                        "the warm worker's heartbeat")
            answered = await gw.client.post("/v1/chat/completions", json=body, headers=gw.auth)
        assert answered.status_code == 200, answered.text
        # Taken from the shared lane, not from the asleep engine's own stream (where only a takeover,
        # once its heartbeat stopped, would have found it).
        assert int(await gw.redis.get(contract.drained_key(COLD, Lane.STANDARD)) or 0) == 1


async def test_a_model_outside_the_catalog_whose_engine_is_starting_is_admitted(tmp_path: Path,
                                                                                redis_url: str) -> None:
    """A worker started by hand serves a model of its own name, in no catalog: while its engine starts,
    a request waits for it rather than being refused (CI once asked as soon as /v1/models listed it)."""
    handmade = "handmade-model"
    async with open_gateway(tmp_path, redis_url) as gw:
        await heartbeat(gw.redis, handmade, WorkerState.STARTING, "starting-1")
        waiting = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=chat(handmade), headers=gw.auth))
        await until(lambda: gw.queued(handmade), lambda n: n == 1, "the request queued for the starting engine")
        async with worker_of(redis_url, handmade):
            answered = await asyncio.wait_for(waiting, WAIT_S)
        assert answered.status_code == 200, answered.text
        # Nothing starting, nothing served lately, not in the catalog: no such model.
        unknown = await gw.client.post("/v1/chat/completions", json=chat("never-heard-of"), headers=gw.auth)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
