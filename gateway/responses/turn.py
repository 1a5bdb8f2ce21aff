"""One ``POST /v1/responses`` request's own part, as its job kind's ``turn`` hook
(:data:`flatfare.gateway.openai.kinds.KINDS`): before the checks, the conversation is expanded (the
earlier turns of ``previous_response_id`` read from the store, the engine told to store nothing);
after, the answer is echoed as the client asked for it and stored when it asked for that. Everything
else (caps, quota, ledger, queue, relay) is the common path of every job kind.

It works on parsed data: the request's body and the worker's replies. Streaming: each of vLLM's
Responses events comes as one chunk and leaves as OpenAI sends it, ``event: <type>`` then
``data: <event>``, with no ``[DONE]`` (the stream ends with its ``response.completed`` event). The
finished response inside that event is stored before the event goes out, so a client that reads it
can fetch the response at once.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

from flatfare.contract import Reply, ReplyKind
from flatfare.gateway.errors import APIError
from flatfare.gateway.responses.conversation import continued, echoed
from flatfare.gateway.responses.protocol import ResponsesRequest
from flatfare.gateway.responses.store import ResponseStore
from flatfare.storage.db import DATABASE_DOWN

log = logging.getLogger("flatfare.gateway")

# Events that carry the finished response: the one to store.
FINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's answer for a response that does not exist, or is another account's."""
    return APIError(404, f"No response found with id '{response_id}'.", param=param,
                    code="previous_response_not_found" if param else "response_not_found")


class ResponseTurn:
    """One response request's answer on its way out: echoed, and stored when asked."""

    def __init__(self, store: ResponseStore | None, account_id: int, items: list[dict[str, Any]], keep: bool,
                 previous_response_id: str | None, added_bytes: int = 0) -> None:
        # What the earlier turns add to the request's body: the plan's body cap bounds the whole conversation.
        self.added_bytes = added_bytes
        self._store = store
        self._account_id = account_id
        self._items = items
        self._keep = keep and store is not None
        self._previous = previous_response_id

    @classmethod
    async def begin(cls, body: dict[str, Any], parsed: ResponsesRequest, account_id: int,
                    store: ResponseStore | None) -> ResponseTurn:
        """Expand the conversation into ``body`` (the engine stores nothing and reads no earlier turn).
        ``store`` None: nothing is kept or read (a batch line, whose answer is in its batch's output file)."""
        previous = None
        if parsed.previous_response_id is not None:
            if store is None:
                raise APIError(400, "previous_response_id is not supported in a batch: send the whole "
                               "conversation as the line's input.", param="previous_response_id",
                               code="unsupported_parameter")
            previous = await store.get(account_id, parsed.previous_response_id)
            if previous is None:
                raise not_found(parsed.previous_response_id, "previous_response_id")
        items = continued(previous, parsed.items())
        body["input"] = items
        body["store"] = False
        body.pop("previous_response_id", None)
        return cls(store, account_id, items, bool(parsed.store), parsed.previous_response_id,
                   previous.size if previous is not None else 0)

    async def whole(self, request_id: str, response: dict[str, Any]) -> dict[str, Any]:
        echoed(response, self._keep, self._previous)
        if self._keep and self._store is not None:
            try:
                await self._store.save(self._account_id, request_id, datetime.now(UTC), response, self._items)
            except DATABASE_DOWN as exc:  # the answer was produced and charged: it still goes out
                log.error("response %s could not be stored: %s", response.get("id"), exc)
        return response

    async def event(self, request_id: str, reply: Reply) -> bytes:
        """One reply of a stream as the client's SSE event; the stream's end is no event of its own."""
        if reply.kind is ReplyKind.END or reply.kind is ReplyKind.HELD:
            return b""
        data = reply.data.encode()
        event = orjson.loads(data)
        if "error" in event and "type" not in event:  # the platform's own: the worker failed, a timeout
            error = event["error"]
            event = {"type": "error", "code": error.get("code"), "message": error.get("message"),
                     "param": error.get("param")}
            data = orjson.dumps(event)
        kind = str(event.get("type", "error"))
        if isinstance(event.get("response"), dict):
            if kind in FINAL_EVENTS:
                await self.whole(request_id, event["response"])
            else:
                echoed(event["response"], self._keep, self._previous)
            data = orjson.dumps(event)
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
