"""One gateway process in the test's own event loop: ``create_app`` on a real Redis and a migrated SQLite
file, its lifespan run as a server runs it (so the batch dispatcher, the reply router and the caches
run too), an httpx client on its ASGI app, and workers that are only their heartbeats (written with the
worker's own ``queue_beat``): a request that passes every check is admitted and, with no engine to
answer it, ends at the gateway's timeout. Seconds a test, for what must be refused before a worker
would be asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from sqlalchemy import func, select, text

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare.contract import WorkerInfo
from flatfare.gateway.app import create_app
from flatfare.gateway.app_state import Services
from flatfare.gateway.settings import GatewaySettings
from flatfare.redis_conn import connect
from flatfare.storage.accounts import issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.db import create_engine, migrate, session_factory
from flatfare.storage.models import ApiKey, RequestRecord
from flatfare.workers.presence import now_ms, queue_beat
from tests.gateway.test_asgi import lifespan

EMBEDDER = "all-minilm-l6-v2"
CHAT_MODEL = "smollm2-135m-instruct"
# The chat model's context as its (heartbeat-only) worker reports it.
CHAT_CONTEXT = 2048
EMBEDDER_CONTEXT = 256
# As the real engine reports it (workers/engine.py effective_config): BERT has no Matryoshka dimensions.
ENGINE_CONFIG = {"runner": "pooling", "embedding_size": 384, "matryoshka_dimensions": False,
                 "max_model_len": EMBEDDER_CONTEXT}


@dataclass
class Gateway:
    client: httpx.AsyncClient
    key: str
    account_id: int
    database_url: str
    redis: aioredis.Redis
    # The app's services, for a test that looks inside.
    services: Services | None = None
    # The ASGI app itself, for a test that needs a client of its own (one that sees a 500's answer).
    app: Any = None

    def refresh_plans(self) -> None:
        """Let the next request read the plans again (they are cached for half a second)."""
        assert self.services is not None
        self.services.plans.plans.cache_clear()

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def counted(self) -> tuple[int, int]:
        """(quota units counted today, ledger rows): what a refused request must leave at zero."""
        day = quota_window("UTC", datetime.now(UTC)).day
        rows = await self.sql_scalar(select(func.count()).select_from(RequestRecord))
        return int(await self.redis.get(counter_key(self.account_id, day)) or 0), rows

    async def sql_scalar(self, query: Any) -> Any:
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session:
                return await session.scalar(query)
        finally:
            await engine.dispose()

    async def sql(self, statement: str, **params: Any) -> list[tuple[Any, ...]]:
        """Run ``statement`` in a transaction of its own; the rows it returns, if any."""
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session, session.begin():
                result = await session.execute(text(statement), params)
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            await engine.dispose()

    async def new_key(self, **limits: Any) -> str:
        """Another key of the account, with its own limits (``allowed_models``, ``daily_limit``...)."""
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session, session.begin():
                account = await ensure_account(session, "acme")
                issued = await issue_key(session, account)
                key = await session.get(ApiKey, issued.key_id)
                for name, value in limits.items():
                    setattr(key, name, value)
                return issued.secret
        finally:
            await engine.dispose()


async def _heartbeat(redis: aioredis.Redis, info: WorkerInfo) -> None:
    while True:
        async with redis.pipeline(transaction=False) as pipe:
            queue_beat(pipe, info, now_ms())
            await pipe.execute()
        await asyncio.sleep(1)


async def seeded_database(tmp_path: Path, accounts: dict[str, str]) -> tuple[str, dict[str, tuple[int, str]]]:
    """A migrated SQLite file in ``tmp_path`` with each account (name -> plan) and one key of it: the file's
    URL, and each account's id and key."""
    database_url = f"sqlite:///{tmp_path / 'gateway.db'}"
    migrate(database_url)
    engine = create_engine(database_url)
    seeded: dict[str, tuple[int, str]] = {}
    async with session_factory(engine)() as session:
        for name, plan in accounts.items():
            account = await ensure_account(session, name, plan)
            seeded[name] = (account.id, (await issue_key(session, account)).secret)
        await session.commit()
    await engine.dispose()
    return database_url, seeded


@asynccontextmanager
async def in_process_gateway(redis_url: str, tmp_path: Path, **settings: Any) -> AsyncIterator[Gateway]:
    """The gateway, an account ``acme`` on Pro with one key, and the two built-in models' heartbeats."""
    database_url, seeded = await seeded_database(tmp_path, {"acme": "pro"})
    account_id, secret = seeded["acme"]
    redis = connect(redis_url)
    beats = [asyncio.create_task(_heartbeat(redis, WorkerInfo(
        worker_id=f"w-{model}", model=model, max_model_len=EMBEDDER_CONTEXT if model == EMBEDDER else CHAT_CONTEXT,
        capacity=8, started_ms=now_ms(), extra={"engine_config": ENGINE_CONFIG} if model == EMBEDDER else {})))
        for model in (EMBEDDER, CHAT_MODEL)]
    # No engine answers here: a request that got through by mistake ends at this timeout, not in ten minutes.
    options: dict[str, Any] = {"request_timeout_s": 10, "log_format": "text", "log_level": "warning", **settings}
    app = create_app(GatewaySettings(redis_url=redis_url, database_url=database_url, data_dir=tmp_path, **options))
    try:
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                    base_url="http://gateway") as client:
            yield Gateway(client, secret, account_id, database_url, redis, app.state.services, app)
    finally:
        for beat in beats:
            beat.cancel()
        await redis.aclose()
