"""A stored response's routes: ``GET /v1/responses/{id}``, ``DELETE`` and its input items. ``POST
/v1/responses`` is a job kind's route, served in front of FastAPI like the others
(:mod:`flatfare.gateway.openai.asgi`; its conversation is the kind's turn,
:mod:`flatfare.gateway.responses.turn`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from flatfare.gateway.deps import CurrentCaller
from flatfare.gateway.errors import ERROR_RESPONSES
from flatfare.gateway.responses.conversation import DEFAULT_PAGE, MAX_PAGE, page
from flatfare.gateway.responses.protocol import MAX_RESPONSE_ID
from flatfare.gateway.responses.turn import not_found
from flatfare.gateway.responses.store import Kept, ResponseStore
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/v1/responses", tags=["openai"], responses=ERROR_RESPONSES)


async def _store(request: Request) -> ResponseStore:
    return services_of(request).response_store


StoreDep = Annotated[ResponseStore, Depends(_store)]


@router.get("/{response_id}")
async def get_response(response_id: str, caller: CurrentCaller, store: StoreDep) -> dict[str, Any]:
    """A stored response, as it was answered."""
    return (await _kept(store, caller.account_id, response_id)).response


@router.delete("/{response_id}")
async def delete_response(response_id: str, caller: CurrentCaller, store: StoreDep) -> dict[str, Any]:
    """Deletes a stored response: it can no longer be read or continued."""
    if not await store.delete(caller.account_id, response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items")
async def list_input_items(response_id: str, caller: CurrentCaller, store: StoreDep,
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE) -> dict[str, Any]:
    """Every input item the stored response's model was given, earlier turns included."""
    kept = await _kept(store, caller.account_id, response_id)
    return page(kept.input_items, response_id, order=order, after=after, limit=limit)


async def _kept(store: ResponseStore, account_id: int, response_id: str) -> Kept:
    kept = await store.get(account_id, response_id) if len(response_id) <= MAX_RESPONSE_ID else None
    if kept is None:
        raise not_found(response_id)
    return kept
