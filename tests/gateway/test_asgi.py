"""The completion routes as plain ASGI, in front of FastAPI: ``create_app`` on a real Redis and SQLite,
its lifespan run through the ASGI app itself, requests sent with httpx's ASGI transport, and an
in-process worker loop on the instant engine where a request must be answered.

Refusals come before any work (headers, then the key, then the body), every error is OpenAI's
envelope, and everything but the two completion routes is FastAPI's."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update

from flatfare import contract
from flatfare.contract import WorkerInfo
from flatfare.gateway.app import create_app
from flatfare.gateway.openai.asgi import MAX_HEADER_BYTES, MAX_HEADERS, CompletionRoutes
from flatfare.gateway.settings import GatewaySettings
from flatfare.redis_conn import connect
from flatfare.storage.accounts import issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.db import create_engine, migrate, session_factory
from flatfare.storage.models import RequestRecord
from flatfare.workers.instant import FILLER, InstantEngine
from flatfare.workers.loop import WorkerLoop
from flatfare.workers.presence import now_ms

MODEL = "instant"
BODY_LIMIT = 4096
ROUTES = ["/v1/chat/completions", "/v1/completions"]
BODIES = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
          "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 3}}


@asynccontextmanager
async def lifespan(app: CompletionRoutes) -> AsyncIterator[None]:
    """Start and stop ``app`` with ASGI lifespan messages, as a server does (through the completion
    layer, which must hand them to FastAPI)."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                    inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await asyncio.wait_for(outbox.get(), 30)
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await asyncio.wait_for(outbox.get(), 30))["type"] == "lifespan.shutdown.complete"
        await task


@dataclass
class Gateway:
    client: httpx.AsyncClient
    key: str
    database_url: str
    redis_url: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def ledger_rows(self) -> int:
        engine = create_engine(self.database_url)
        try:
            async with session_factory(engine)() as session:
                return await session.scalar(select(func.count()).select_from(RequestRecord))
        finally:
            await engine.dispose()


@pytest.fixture
def database_file(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    migrate(url)
    yield url


@pytest.fixture
async def gateway(request: pytest.FixtureRequest, database_file: str, redis_url: str,
                  tmp_path: Path) -> AsyncIterator[Gateway]:
    """The gateway on ``database_file``; settings of a test's own as the fixture's parameter."""
    engine = create_engine(database_file)
    async with session_factory(engine)() as session:
        issued = await issue_key(session, await ensure_account(session, "acme", "pro"))
        await session.commit()
    await engine.dispose()
    settings = GatewaySettings(redis_url=redis_url, database_url=database_file, data_dir=tmp_path,
                               max_body_bytes=BODY_LIMIT, log_format="text", log_level="warning",
                               **getattr(request, "param", {}))
    app = create_app(settings)
    async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                base_url="http://gateway") as client:
        yield Gateway(client, issued.secret, database_file, redis_url)


@pytest.fixture
async def worker(redis_url: str) -> AsyncIterator[WorkerLoop]:
    """One worker of the instant engine, in this process, until the test ends."""
    client = connect(redis_url)
    engine = InstantEngine(tokens=3)
    loop = WorkerLoop(client, engine, WorkerInfo(worker_id="w1", model=MODEL, max_model_len=engine.max_model_len,
                                                 capacity=8, engine="instant", started_ms=now_ms()))
    task = asyncio.create_task(loop.run())
    deadline = time.monotonic() + 30
    while await client.zscore(contract.pool_key(MODEL), "w1") is None:  # until its first heartbeat
        assert time.monotonic() < deadline and not task.done(), "the worker did not start"
        await asyncio.sleep(0.02)
    yield loop
    loop.stop()
    await asyncio.wait_for(task, 30)
    await client.aclose()


def assert_error(response: httpx.Response, status: int, code: str | None, type_: str | None = None) -> dict[str, Any]:
    """An OpenAI error envelope: exactly message, type, param and code, sent as JSON."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    return error


@pytest.mark.parametrize("route", ROUTES)
async def test_a_request_without_a_valid_key_is_refused(gateway, route: str) -> None:
    missing = await gateway.client.post(route, json=BODIES[route])
    assert_error(missing, 401, "invalid_api_key", "authentication_error")
    wrong = await gateway.client.post(route, json=BODIES[route], headers={"Authorization": "Bearer ff-nope"})
    assert_error(wrong, 401, "invalid_api_key", "authentication_error")
    # The key is checked before the body is read: a stranger's oversized body is a 401, not a 413.
    huge = await gateway.client.post(route, content=b"x" * (BODY_LIMIT * 4))
    assert_error(huge, 401, "invalid_api_key")
    assert await gateway.ledger_rows() == 0


@pytest.mark.parametrize("route", [*ROUTES, "/v1/models"])
async def test_too_many_header_lines_are_refused_on_every_route(gateway, route: str) -> None:
    """Bounded before anything else (even the key), on the completion routes and FastAPI's alike."""
    many = [(f"x-filler-{i}", "1") for i in range(MAX_HEADERS)]
    method = "GET" if route == "/v1/models" else "POST"
    too_many = await gateway.client.request(method, route, headers=[*gateway.auth.items(), *many])
    assert_error(too_many, 431, "request_headers_too_large")
    too_big = await gateway.client.request(method, route, headers={**gateway.auth,
                                                                   "x-filler": "a" * MAX_HEADER_BYTES})
    assert_error(too_big, 431, "request_headers_too_large")
    assert await gateway.ledger_rows() == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_a_body_past_the_limit_is_refused(gateway, route: str) -> None:
    padded = {**BODIES[route], "user": "x" * BODY_LIMIT}
    declared = await gateway.client.post(route, json=padded, headers=gateway.auth)
    assert_error(declared, 413, "request_too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(8):
            yield b" " * (BODY_LIMIT // 2)

    streamed = await gateway.client.post(route, content=chunks(), headers=gateway.auth)
    assert "content-length" not in streamed.request.headers
    assert_error(streamed, 413, "request_too_large")
    # Refused errors carry the caller's rate-limit headers, and cost nothing.
    assert declared.headers["x-ratelimit-remaining-requests"] == declared.headers["x-ratelimit-limit-requests"]
    assert await gateway.ledger_rows() == 0


async def test_bad_requests_get_openais_envelope(gateway) -> None:
    not_json = await gateway.client.post("/v1/chat/completions", content=b"{", headers=gateway.auth)
    assert_error(not_json, 400, not_json.json()["error"]["code"], "invalid_request_error")
    no_messages = await gateway.client.post("/v1/chat/completions", json={"model": MODEL}, headers=gateway.auth)
    assert assert_error(no_messages, 400, no_messages.json()["error"]["code"])["param"] == "messages"
    unknown = await gateway.client.post("/v1/chat/completions", json={**BODIES["/v1/chat/completions"],
                                                                      "model": "no-such-model"},
                                        headers=gateway.auth)
    assert assert_error(unknown, 404, "model_not_found")["param"] == "model"
    assert "x-ratelimit-limit-requests" in unknown.headers


@pytest.mark.parametrize("route", ROUTES)
async def test_a_request_is_answered_by_the_worker(gateway, worker, route: str) -> None:
    answered = await gateway.client.post(route, json=BODIES[route], headers=gateway.auth)
    assert answered.status_code == 200, answered.text
    assert answered.headers["content-type"] == "application/json"
    request_id = answered.headers["x-request-id"]
    body = answered.json()
    assert body["id"].endswith(request_id) and body["usage"]["completion_tokens"] == 3
    assert answered.headers["x-ratelimit-remaining-requests"] == str(
        int(answered.headers["x-ratelimit-limit-requests"]) - 1)

    async with gateway.client.stream("POST", route, json={**BODIES[route], "stream": True},
                                     headers=gateway.auth) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = [line async for line in streamed.aiter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = [c["choices"][0]["delta"]["content"] if "delta" in c["choices"][0] else c["choices"][0]["text"]
            for c in chunks]
    assert text == [FILLER] * 3
    assert await gateway.ledger_rows() == 2


@pytest.mark.parametrize("gateway", [{"idempotency_window_s": 60}], indirect=True)
async def test_a_retry_past_the_idempotency_window_is_a_new_request(gateway, worker) -> None:
    """Within FLATFARE_IDEMPOTENCY_WINDOW_S a retry replays the first answer, counted and charged once;
    past it (the first row aged 2 minutes against a 60-second window) the same key is a new request."""
    route, headers = "/v1/chat/completions", {**gateway.auth, "Idempotency-Key": "order-7"}
    first = await gateway.client.post(route, json=BODIES[route], headers=headers)
    replayed = await gateway.client.post(route, json=BODIES[route], headers=headers)
    assert first.status_code == replayed.status_code == 200, (first.text, replayed.text)
    assert replayed.json()["id"] == first.json()["id"] and await gateway.ledger_rows() == 1
    engine = create_engine(gateway.database_url)
    try:
        async with session_factory(engine)() as session:
            await session.execute(update(RequestRecord).values(created_at=datetime.now(UTC) - timedelta(minutes=2)))
            await session.commit()
    finally:
        await engine.dispose()
    again = await gateway.client.post(route, json=BODIES[route], headers=headers)
    assert again.status_code == 200 and again.json()["id"] != first.json()["id"], again.text
    assert await gateway.ledger_rows() == 2


async def test_every_other_route_is_fastapis(gateway, worker) -> None:
    # FastAPI's routes, dependencies and middlewares: the key check, the models list, probes.
    assert_error(await gateway.client.get("/v1/models"), 401, "invalid_api_key")
    models = await gateway.client.get("/v1/models", headers=gateway.auth)
    assert models.status_code == 200 and MODEL in {m["id"] for m in models.json()["data"]}
    assert "x-ratelimit-limit-requests" in models.headers  # FastAPI's RateLimitHeaders middleware
    assert (await gateway.client.get("/healthz")).json() == {"status": "ok"}
    # Its router answers what the completion layer does not serve, in the same envelope.
    assert_error(await gateway.client.get("/v1/chat/completions", headers=gateway.auth), 405, None)
    assert_error(await gateway.client.post("/v1/nope", json={}, headers=gateway.auth), 404, "not_found")
    assert_error(await gateway.client.post("/v1/chat/completions/", json={}, headers=gateway.auth), 404, "not_found")
    # FastAPI still documents the routes it never serves.
    paths = (await gateway.client.get("/openapi.json")).json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= set(paths)


async def test_shutdown_cancels_a_background_pass_that_overstays_its_grace(caplog: pytest.LogCaptureFixture) -> None:
    """A pass stuck inside its work (a database lock, a slow webhook) cannot hold the process's shutdown:
    it is cancelled after the grace and named in the log; a pass that ends at ``stop`` is left to end."""
    from flatfare.gateway.app import _stop

    stop = asyncio.Event()
    ended = []

    async def polite() -> None:
        await stop.wait()
        ended.append("polite")

    async def stuck() -> None:
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(polite(), name="polite"), asyncio.create_task(stuck(), name="stuck")]
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(_stop(tasks, grace_s=0.2), 10)
    assert ended == ["polite"] and tasks[1].cancelled()
    assert "background pass stuck still running" in caplog.text
