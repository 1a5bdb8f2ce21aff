"""``/v1/batches``: OpenAI's Batch API routes (parse, call :class:`BatchService`, map the result)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from flatfare.gateway.batches.protocol import BatchCreate, batch_object
from flatfare.gateway.batches.service import BatchService
from flatfare.gateway.deps import CurrentCaller
from flatfare.gateway.errors import ERROR_RESPONSES
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=ERROR_RESPONSES)


def _service(request: Request) -> BatchService:
    return services_of(request).batches


@router.post("")
async def create_batch(request: Request, caller: CurrentCaller, body: BatchCreate) -> dict[str, Any]:
    return batch_object(await _service(request).create(caller, body, getattr(request.state, "traceparent", "")))


@router.get("/{batch_id}")
async def retrieve_batch(request: Request, caller: CurrentCaller, batch_id: str) -> dict[str, Any]:
    return batch_object(await _service(request).get(caller, batch_id))


@router.post("/{batch_id}/cancel")
async def cancel_batch(request: Request, caller: CurrentCaller, batch_id: str) -> dict[str, Any]:
    return batch_object(await _service(request).cancel(caller, batch_id))


@router.get("")
async def list_batches(request: Request, caller: CurrentCaller, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    batches, has_more = await _service(request).list(caller, after, limit)
    data = [batch_object(batch) for batch in batches]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
