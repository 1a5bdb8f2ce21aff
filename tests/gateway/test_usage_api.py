"""``GET /v1/usage`` on a real Redis and SQLite, through ``create_app``: the account's and each key's
caps and what they have in flight now."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from flatfare import contract
from flatfare.gateway.app import create_app
from flatfare.gateway.settings import GatewaySettings
from flatfare.storage.accounts import KeyLimitsUpdate, issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.db import create_engine, migrate, session_factory
from flatfare.storage.models import Account
from tests.gateway.test_asgi import assert_error, lifespan


@dataclass
class Usage:
    client: httpx.AsyncClient
    database_url: str
    account_id: int
    capped: tuple[int, str]  # (key id, secret), with max_inflight 2
    plain: tuple[int, str]

    async def read(self, secret: str) -> dict:
        response = await self.client.get("/v1/usage", headers={"Authorization": f"Bearer {secret}"})
        assert response.status_code == 200, response.text
        return response.json()

    async def set_override(self, cap: int | None) -> None:
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session:
                (await session.get(Account, self.account_id)).max_inflight_override = cap
                await session.commit()
        finally:
            await engine.dispose()


@pytest.fixture
async def usage(redis_url: str, tmp_path: Path) -> AsyncIterator[Usage]:
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    migrate(url)
    engine = create_engine(url)
    async with session_factory(engine)() as session:
        account = await ensure_account(session, "acme", "pro")
        capped = await issue_key(session, account, "batch", KeyLimitsUpdate(max_inflight=2))
        plain = await issue_key(session, account, "web")
        await session.commit()
    await engine.dispose()
    settings = GatewaySettings(redis_url=redis_url, database_url=url, data_dir=tmp_path, auth_cache_ttl_s=0,
                               log_format="text", log_level="warning")
    app = create_app(settings)
    async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                base_url="http://gateway") as client:
        yield Usage(client, url, account.id, (capped.key_id, capped.secret), (plain.key_id, plain.secret))


async def test_usage_shows_each_caps_and_the_requests_in_flight_now(usage: Usage, redis: aioredis.Redis) -> None:
    now_ms = int(time.time() * 1000)
    live, gone = now_ms + 600_000, now_ms - 1_000  # an entry past its expiry was left by a dead process
    await redis.zadd(contract.inflight_key(usage.account_id), {"r1": live, "r2": live, "r3": live, "old": gone})
    await redis.zadd(contract.key_inflight_key(usage.capped[0]), {"r1": live, "r2": live, "old": gone})
    await redis.zadd(contract.key_inflight_key(usage.plain[0]), {"r3": live})
    await redis.zadd(contract.inflight_key(usage.account_id + 1), {"theirs": live})  # another account's
    body = await usage.read(usage.plain[1])
    assert (body["inflight"], body["max_inflight"]) == (3, 16)  # the pro plan's cap
    keys = {key["id"]: key for key in body["today"]["keys"]}
    assert (keys[usage.capped[0]]["inflight"], keys[usage.capped[0]]["max_inflight"]) == (2, 2)
    assert (keys[usage.plain[0]]["inflight"], keys[usage.plain[0]]["max_inflight"]) == (1, None)
    # The account's override replaces the plan's cap; cleared, the plan's is back.
    await usage.set_override(40)
    assert (await usage.read(usage.plain[1]))["max_inflight"] == 40
    await usage.set_override(None)
    assert (await usage.read(usage.plain[1]))["max_inflight"] == 16


async def test_usage_without_redis_is_a_clean_503(usage: Usage, redis: aioredis.Redis, monkeypatch) -> None:
    async def refuse(*_args: object, **_kwargs: object) -> None:
        raise ConnectionError("Redis is away")

    monkeypatch.setattr(aioredis.client.Pipeline, "execute", refuse)
    response = await usage.client.get("/v1/usage", headers={"Authorization": f"Bearer {usage.plain[1]}"})
    assert_error(response, 503, "quota_unavailable")
