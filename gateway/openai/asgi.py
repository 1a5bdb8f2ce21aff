"""The job kinds' routes as plain ASGI: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``POST /v1/embeddings`` (one per :class:`~flatfare.contract.Endpoint`).

These routes carry nearly all of the platform's traffic, so they skip FastAPI's routing,
dependency solving and middleware stack (a third of the gateway's CPU a request, measured in
bench/results/profile.md): :class:`CompletionRoutes` wraps the FastAPI application from outside
(Starlette's own outermost layer cost 5 % more), reads the few headers it needs, the bounded body,
authenticates, hands the rest to :class:`~flatfare.gateway.openai.service.CompletionService`, and sends its
:class:`~flatfare.gateway.openai.relay.Answer` itself, with the same metrics, log line, rate-limit headers and
OpenAI error bodies as every other route. FastAPI still declares them (gateway/openai/routes.py),
so ``/docs`` and ``/openapi.json`` document them; every other request, and the lifespan, pass
through to FastAPI untouched.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import orjson
from redis.exceptions import RedisError
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from flatfare import tracecontext
from flatfare.billing.quota import QuotaUnavailable
from flatfare.contract import ENDPOINT_PATHS, Endpoint
from flatfare.gateway.auth import Caller
from flatfare.gateway.openai.relay import CLIENT_CLOSED, Answer, Call
from flatfare.gateway.errors import APIError, database_unavailable, error_body, queue_unreachable
from flatfare.gateway.metrics import GatewayMetrics, error_code, observe
from flatfare.gateway.quota_headers import current_headers
from flatfare.logs import bind
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.gateway.app_state import Services
from flatfare.tracing import Tracer

log = logging.getLogger("flatfare.gateway")

# Every job kind's route (chat, completions, embeddings): each goes through the same service.
ROUTES = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items()}
# The request headers the service reads (ASGI gives names lower-cased, as bytes).
_WANTED = {b"authorization", b"content-length", b"idempotency-key", b"x-flatfare-max-queue-ms", b"traceparent",
           b"user-agent"}
# uvicorn (httptools) accepts any header size; these are the bounds every route gets (431 past them).
MAX_HEADERS = 100
MAX_HEADER_BYTES = 64 * 1024
_CONTENT_TYPE = {"application/json": b"application/json", "text/event-stream": b"text/event-stream; charset=utf-8"}


class CompletionRoutes:
    """The gateway's ASGI application: the FastAPI app, with the completion routes served in front of
    it. Anything else asked of it (``state``, ``openapi()``, ``routes``) is the FastAPI app's."""

    def __init__(self, api: FastAPI, metrics: GatewayMetrics, tracer: Tracer | None = None) -> None:
        self.api = api
        self.metrics = metrics
        self.tracer = tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _headers_too_large(scope["headers"]):
            await _send(Answer(431, {}, body=orjson.dumps(error_body(
                431, f"The request's headers are too large: at most {MAX_HEADERS} headers of "
                f"{MAX_HEADER_BYTES} bytes in all.", code="request_headers_too_large"))), Call({}), send)
            return
        endpoint = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.api(scope, receive, send)
            return
        # Each request runs in a task of its own, whose context is a copy: fields bound while
        # serving it (flatfare.logs.bind) end with it.
        await self._serve(endpoint, scope, receive, send)

    async def _serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        state: Services = self.api.state.services
        headers = {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in _WANTED}
        # scope["client"]: the peer, or the address a trusted proxy forwarded (uvicorn's and granian's
        # proxy-header handling, from FLATFARE_FORWARDED_ALLOW_IPS), as the console's login lock sees it.
        peer = scope.get("client")
        call = Call(headers, lambda c: _watch(receive, c), client=peer[0] if peer else None)
        if self.tracer is None:
            trace = tracecontext.continue_or_start(headers.get(tracecontext.HEADER))
        else:  # sampled here, at the edge: the job's traceparent carries the decision on
            trace, call.spans = self.tracer.start(f"POST {scope['path']}", headers.get(tracecontext.HEADER),
                                                  kind="server", **{"http.request.method": "POST",
                                                                    "http.route": scope["path"]})
        bind(**trace.log_fields())
        call.traceparent = trace.header()
        caller: Caller | None = None
        status = 500
        code: str | None = "internal_error"
        request_id: str | None = None
        self.metrics.in_progress.inc()
        try:
            try:
                caller = await state.authenticator.authenticate(headers.get("authorization"))
                raw = await read_body(receive, headers.get("content-length"), state.settings.max_body_bytes)
                answer = await state.completions.handle(endpoint, raw, caller, call)
            except APIError as exc:
                answer = await _error(exc, state, caller, call)
            except RedisError:
                answer = await _error(queue_unreachable(), state, caller, call)
            except DATABASE_DOWN:  # accounts or plans unreadable: nothing was counted
                answer = await _error(database_unavailable(), state, None, call)
            request_id = answer.headers.get("x-request-id")
            status = answer.status
            code = error_code(answer.body) if status >= 400 else None
            if status != CLIENT_CLOSED or not call.gone:
                await _send(answer, call, send)
            if call.spans is not None:
                call.spans.end("relay")
            if answer.after is not None:
                await answer.after()
        except Exception:
            log.exception("unexpected error on %s", scope["path"])
            with contextlib.suppress(Exception):
                await _send(Answer(500, {}, body=orjson.dumps(error_body(
                    500, "The server had an error while processing your request; retry it.",
                    code="internal_error"))), call, send)
            raise
        finally:
            if call.watcher is not None:
                call.watcher.cancel()
            self.metrics.in_progress.dec()
            labels = call.labels
            plan = labels.get("plan") or (caller.account.plan if caller is not None else "")
            observe(self.metrics, "POST", scope["path"], status, time.perf_counter() - started,
                    request_id=request_id, caller=caller, plan=plan, model=labels.get("model", ""),
                    lane=labels.get("lane", ""), code=code)
            if call.spans is not None:
                call.spans.finish(status, code, **{"flatfare.request_id": request_id, "flatfare.plan": plan,
                                                   "flatfare.model": labels.get("model")})


def _headers_too_large(headers: list[tuple[bytes, bytes]]) -> bool:
    return len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes the configured limit."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(CLIENT_CLOSED, "The client closed the connection.", code="client_closed")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this platform's limit of {limit} bytes.",
                    code="request_too_large")


async def _watch(receive: Receive, call: Call) -> None:
    """Wait for the client to disconnect (the body is read, so nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    call.left()


async def _error(exc: APIError, state: Services, caller: Caller | None, call: Call) -> Answer:
    headers = dict(exc.headers)
    limits = call.ratelimit
    if limits is None and caller is not None and exc.status != CLIENT_CLOSED:
        try:
            limits = await current_headers(state, caller)
        except (*REDIS_DOWN, RuntimeError, QuotaUnavailable):
            # Headers of an error answer: with Redis away (uvloop says so with a RuntimeError while a
            # connection is torn down), the error goes out without them rather than as a 500.
            limits = None
    for name, value in (limits or {}).items():
        headers.setdefault(name, value)
    body = orjson.dumps(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    return Answer(exc.status, headers, body=body)


async def _send(answer: Answer, call: Call, send: Send) -> None:
    raw_headers = [(b"content-type", _CONTENT_TYPE.get(answer.media_type, answer.media_type.encode()))]
    if answer.stream is None:
        raw_headers.append((b"content-length", str(len(answer.body)).encode()))
    limits = call.ratelimit or {}
    for name, value in (*answer.headers.items(), *((k, v) for k, v in limits.items() if k not in answer.headers)):
        raw_headers.append((name.lower().encode(), value.encode("latin-1")))
    if call.traceparent:
        raw_headers.append((b"traceparent", call.traceparent.encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": raw_headers})
    if answer.stream is None:
        await send({"type": "http.response.body", "body": answer.body})
        return
    stream = answer.stream
    try:
        async for chunk in stream:
            if call.gone:
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if not call.gone:
            await send({"type": "http.response.body", "body": b""})
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
