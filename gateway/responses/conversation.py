"""A conversation continued with ``previous_response_id``, as input items the worker is given.

vLLM keeps earlier responses in one worker's memory (and only when its store is switched on), so the
gateway expands the conversation itself: the earlier response's input items, then its output items
(output items are valid input: messages, function calls, reasoning), then the new input. The engine
gets no ``previous_response_id`` and ``store`` false; what the client asked for is echoed back in the
response it gets. Plain functions, testable without HTTP, Redis or a database.
"""

from __future__ import annotations

from typing import Any

from flatfare.gateway.responses.store import Kept

# Listing a response's input items: OpenAI's page bounds and its default order (newest first).
MAX_PAGE = 100
DEFAULT_PAGE = 20


def continued(previous: Kept | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every input item the model is given: the earlier turns (through ``previous``), then ``items``.
    Instructions are not carried over, as on OpenAI: each request gives its own."""
    if previous is None:
        return items
    return [*previous.input_items, *previous.response.get("output", ()), *items]


def echoed(response: dict[str, Any], store: bool, previous_response_id: str | None) -> dict[str, Any]:
    """``response`` as the client asked for it: vLLM saw ``store`` false and no previous response."""
    response["store"] = store
    response["previous_response_id"] = previous_response_id
    return response


def page(items: list[dict[str, Any]], response_id: str, *, order: str = "desc", after: str | None = None,
         limit: int = DEFAULT_PAGE) -> dict[str, Any]:
    """One page of a response's input items, as OpenAI lists them. An item without an id (input the
    client wrote) gets one from its position, stable across reads."""
    listed = [item if "id" in item else {"id": f"{response_id}_item{i}", **item} for i, item in enumerate(items)]
    if order == "desc":
        listed.reverse()
    if after is not None:
        ids = [item["id"] for item in listed]
        listed = listed[ids.index(after) + 1:] if after in ids else []
    data = listed[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(listed) > limit}
