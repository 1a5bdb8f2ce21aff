"""One completion request through the platform: validate, route, record, queue, answer.

Everything a client can get wrong is refused here, before the ledger or the queue see the request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import anyio
import orjson
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from billing.ledger import Ledger, Outcome
from flatfare.contract import Endpoint, Job, Reply, ReplyKind
from flatfare.storage.models import RequestStatus
from gateway.auth import Caller
from gateway.errors import APIError, error_body, invalid, validation_error
from gateway.pools import Pool, Pools
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.replies import Dispatcher

_MODELS = {Endpoint.CHAT: ChatCompletionRequest, Endpoint.COMPLETION: CompletionRequest}
# Fields only the platform sets: the engine's request id and scheduling priority.
_RESERVED_FIELDS = ("request_id", "priority")
_JSON = "application/json"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499


def new_request_id() -> str:
    return uuid.uuid4().hex


def parse_body(endpoint: Endpoint, raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request. Send a JSON object "
                       "with 'Content-Type: application/json'.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    try:
        parsed = _MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        raise validation_error(list(exc.errors()), body) from None
    return body, parsed


def check_fits(parsed: ChatCompletionRequest | CompletionRequest, pool: Pool) -> None:
    wanted = parsed.output_tokens()
    if wanted is not None and wanted > pool.max_model_len:
        param = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise invalid(f"{param} is too large: {wanted}. The model '{pool.model}' supports at most "
                      f"{pool.max_model_len} tokens of context.", param=param)


def _outcome(reply: Reply, created_ms: int, finished_ms: int) -> Outcome:
    usage = reply.usage
    failed = reply.kind is ReplyKind.ERROR
    error_code = None
    if failed:
        error_code = (orjson.loads(reply.data).get("error") or {}).get("code") or f"http_{reply.status}"
    return Outcome(
        status=RequestStatus.FAILED if failed else RequestStatus.SUCCEEDED,
        http_status=reply.status,
        queue_ms=max(reply.started_ms - created_ms, 0) if reply.started_ms else None,
        ttft_ms=max(reply.first_token_ms - created_ms, 0) if reply.first_token_ms else None,
        duration_ms=finished_ms - created_ms,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        error_code=str(error_code) if error_code else None,
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class CompletionService:
    def __init__(self, pools: Pools, dispatcher: Dispatcher, ledger: Ledger) -> None:
        self._pools = pools
        self._dispatcher = dispatcher
        self._ledger = ledger

    async def handle(self, endpoint: Endpoint, raw: bytes, caller: Caller, request: Request) -> Response:
        body, parsed = parse_body(endpoint, raw)
        pool = await self._pools.route(parsed.model)
        check_fits(parsed, pool)
        for field in _RESERVED_FIELDS:
            body.pop(field, None)

        request_id = new_request_id()
        created_ms = _now_ms()
        stream = bool(parsed.stream)
        await self._ledger.open(
            request_id=request_id, account_id=caller.account_id, api_key_id=caller.key_id, model=pool.model,
            endpoint=endpoint.value, stream=stream, created_at=datetime.fromtimestamp(created_ms / 1000, UTC))
        job = Job(request_id=request_id, endpoint=endpoint, body=orjson.dumps(body).decode(), enqueued_ms=created_ms)
        try:
            await self._dispatcher.submit(pool.model, job)
        except RedisError:
            await self._ledger.close(request_id, Outcome(RequestStatus.FAILED, 503, error_code="queue_unavailable"))
            raise APIError(503, "The request queue is unreachable; retry shortly.", code="queue_unavailable",
                           headers={"Retry-After": "1"}) from None

        headers = {"x-request-id": request_id}
        replies = self._dispatcher.replies(request_id)
        first = await self._first_reply(request_id, created_ms, replies, request)
        if first is None:
            return Response(status_code=CLIENT_CLOSED, headers=headers)
        if first.kind.terminal:
            return self._whole(request_id, created_ms, first, headers)
        return StreamingResponse(self._sse(request_id, created_ms, first, replies),
                                 media_type="text/event-stream", headers={**headers, **_SSE_HEADERS})

    async def _first_reply(self, request_id: str, created_ms: int, replies: AsyncIterator[Reply],
                           request: Request) -> Reply | None:
        """The first reply, or None if the client left first (the job is then cancelled)."""
        reading = asyncio.ensure_future(anext(replies))
        leaving = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not reading.done():
                reading.cancel()
        if reading.done() and not reading.cancelled():
            try:
                return reading.result()
            except APIError as exc:
                await self._abandon(request_id, created_ms, RequestStatus.FAILED, exc.status, exc.code)
                raise
        await self._abandon(request_id, created_ms, RequestStatus.CANCELLED, CLIENT_CLOSED, "client_closed")
        return None

    async def _abandon(self, request_id: str, created_ms: int, status: RequestStatus, http_status: int,
                       code: str | None) -> None:
        await self._dispatcher.cancel(request_id)
        await self._ledger.close(request_id, Outcome(status, http_status, duration_ms=_now_ms() - created_ms,
                                                     error_code=code))

    def _whole(self, request_id: str, created_ms: int, reply: Reply, headers: dict[str, str]) -> Response:
        outcome = _outcome(reply, created_ms, _now_ms())

        async def finish() -> None:
            await self._ledger.close(request_id, outcome)
            await self._dispatcher.forget(request_id)

        # A stream that ends at once (END first) still owes the client its [DONE].
        content = _DONE if reply.kind is ReplyKind.END else reply.data
        media_type = "text/event-stream" if reply.kind is ReplyKind.END else _JSON
        return Response(content=content, status_code=reply.status, media_type=media_type, headers=headers,
                        background=BackgroundTask(finish))

    async def _sse(self, request_id: str, created_ms: int, first: Reply,
                   replies: AsyncIterator[Reply]) -> AsyncIterator[bytes]:
        last = first
        timed_out = False
        try:
            yield _event(first.data)
            async for reply in replies:
                last = reply
                if reply.kind is ReplyKind.CHUNK:
                    yield _event(reply.data)
                elif reply.kind is ReplyKind.ERROR:  # the worker failed mid-stream
                    yield _event(reply.data) + _DONE
                else:
                    yield _DONE
        except APIError as exc:  # no terminal reply before the deadline
            timed_out = True
            yield _event(orjson.dumps(error_body(exc.status, exc.message, code=exc.code)).decode()) + _DONE
        finally:
            # Runs when the client leaves too (the response task is cancelled): shield the bookkeeping.
            with anyio.CancelScope(shield=True):
                if timed_out:
                    await self._abandon(request_id, created_ms, RequestStatus.FAILED, 504, "timeout")
                elif last.kind.terminal:
                    await self._ledger.close(request_id, _outcome(last, created_ms, _now_ms()))
                    await self._dispatcher.forget(request_id)
                else:
                    await self._abandon(request_id, created_ms, RequestStatus.CANCELLED, CLIENT_CLOSED,
                                        "client_closed")


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"
