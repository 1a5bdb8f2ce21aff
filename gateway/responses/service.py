"""``POST /v1/responses`` through the platform: the conversation expanded, then the same path as every
job kind (:class:`~flatfare.gateway.openai.service.CompletionService`: caps, quota, ledger, queue,
relay), then the finished response stored for its account and echoed as the client asked for it.

Streaming: the worker sends each of vLLM's Responses events as one chunk; they leave here as OpenAI
sends them, ``event: <type>`` then ``data: <event>``, with no ``[DONE]`` (the Responses stream ends
with its ``response.completed`` event). The finished response inside that event is stored before the
event goes out, so a client that reads it can fetch the response at once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson

from flatfare.contract import Endpoint
from flatfare.gateway.auth import Caller
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.kinds import parse_body
from flatfare.gateway.openai.service import Answer, Call, CompletionService
from flatfare.gateway.responses.conversation import continued, echoed
from flatfare.gateway.responses.protocol import ResponsesRequest
from flatfare.gateway.responses.store import ResponseStore
from flatfare.storage.db import DATABASE_DOWN

log = logging.getLogger("flatfare.gateway")

# Events that carry the finished response: the one to store.
FINAL_EVENTS = frozenset((b"response.completed", b"response.incomplete", b"response.failed"))
_JSON = "application/json"


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's answer for a response that does not exist, or is another account's."""
    return APIError(404, f"No response found with id '{response_id}'.", param=param,
                    code="previous_response_not_found" if param else "response_not_found")


class ResponsesService:
    def __init__(self, completions: CompletionService, store: ResponseStore) -> None:
        self._completions = completions
        self._store = store

    async def create(self, raw: bytes, caller: Caller, call: Call) -> Answer:
        body, parsed = parse_body(Endpoint.RESPONSES, raw)
        assert isinstance(parsed, ResponsesRequest)
        previous = None
        if parsed.previous_response_id is not None:
            previous = await self._store.get(caller.account_id, parsed.previous_response_id)
            if previous is None:
                raise not_found(parsed.previous_response_id, "previous_response_id")
        items = continued(previous, parsed.items())
        body["input"] = items
        body["store"] = False
        body.pop("previous_response_id", None)
        # Caps and the plan's input size apply to the whole conversation the engine reads.
        answer = await self._completions.handle(Endpoint.RESPONSES, orjson.dumps(body), caller, call)
        turn = _Turn(self._store, caller.account_id, answer.headers.get("x-request-id", ""), items,
                     bool(parsed.store), parsed.previous_response_id)
        if answer.stream is not None:
            answer.stream = turn.events(answer.stream)
        elif answer.media_type == _JSON and answer.status == 200:
            answer.body = orjson.dumps(await turn.finished(orjson.loads(answer.body)))
        elif answer.status == 200:  # a stream that ended at once: its events in one body
            answer.body = b"".join([chunk async for chunk in turn.events(_once(answer.body))])
        return answer


class _Turn:
    """One response request's answer on its way out: echoed, and stored when asked."""

    def __init__(self, store: ResponseStore, account_id: int, request_id: str, items: list[dict[str, Any]],
                 keep: bool, previous_response_id: str | None) -> None:
        self._store = store
        self._account_id = account_id
        self._request_id = request_id
        self._items = items
        self._keep = keep
        self._previous = previous_response_id

    async def finished(self, response: dict[str, Any]) -> dict[str, Any]:
        echoed(response, self._keep, self._previous)
        if self._keep:
            try:
                await self._store.save(self._account_id, self._request_id, datetime.now(UTC), response, self._items)
            except DATABASE_DOWN as exc:  # the answer was produced and charged: it still goes out
                log.error("response %s could not be stored: %s", response.get("id"), exc)
        return response

    async def events(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                out = [await self._event(block[6:]) for block in chunk.split(b"\n\n")
                       if block.startswith(b"data: ") and block != b"data: [DONE]"]
                if out:
                    yield b"".join(out)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _event(self, data: bytes) -> bytes:
        event = orjson.loads(data)
        if "error" in event and "type" not in event:  # the platform's own: the worker failed, a timeout
            error = event["error"]
            event = {"type": "error", "code": error.get("code"), "message": error.get("message"),
                     "param": error.get("param")}
            data = orjson.dumps(event)
        kind = str(event.get("type", "error")).encode()
        if isinstance(event.get("response"), dict):
            if kind in FINAL_EVENTS:
                await self.finished(event["response"])
            else:
                echoed(event["response"], self._keep, self._previous)
            data = orjson.dumps(event)
        return b"event: " + kind + b"\ndata: " + data + b"\n\n"


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body
