"""The OpenAI-compatible ``/v1`` routes: parse, call the service, map the result."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from flatfare.gateway.auth import Caller
from flatfare.gateway.deps import CurrentCaller, PlansDep, PoolsDep
from flatfare.gateway.errors import ERROR_RESPONSES, APIError
from flatfare.gateway.openai.kinds import KINDS

router = APIRouter(prefix="/v1", tags=["openai"], responses=ERROR_RESPONSES)


def _body_schema(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


# Every job kind is served by flatfare.gateway.openai.asgi.CompletionRoutes before FastAPI routes anything;
# declared here so /docs and /openapi.json document them with their bodies and the API key they need.
async def _served_outside(_: CurrentCaller) -> Response:
    raise APIError(500, "This route is served by the gateway's completion middleware; it was bypassed.",
                   code="internal_error")


for _kind in KINDS.values():
    router.add_api_route(_kind.endpoint.path.removeprefix("/v1"), _served_outside, methods=["POST"],
                         name=_kind.endpoint.value, description=_kind.summary,
                         openapi_extra=_body_schema(_kind.wire))


async def _model_cards(pools: PoolsDep, plans: PlansDep, caller: Caller) -> list[dict[str, Any]]:
    """OpenAI's model objects, plus Flatfare's: ``state`` (warm, waking, starting, asleep, cold or
    unavailable), ``expected_ready_s`` for an asleep or cold model whose last wake or start was
    measured, ``context_length`` and the ``capabilities`` its catalog entry gives it (null for a model
    outside the catalog); only the models the caller's plan and key may use."""
    catalog = await pools.catalog()
    plan = (await plans.terms(caller.account, datetime.now(UTC))).plan
    cards = []
    for name, status in (await pools.model_states()).items():
        entry = catalog.get(name)
        if not (caller.key.allows_model(name) and plan.allows_model(name) and (entry is None or
                                                                              entry.allows_plan(plan.name))):
            continue
        card = {"id": name, "object": "model", "created": entry.created if entry else 0,
                "owned_by": "flatfare", "state": status.state.value,
                "context_length": await pools.context_length(entry, name),
                "capabilities": entry.capabilities.public() if entry else None}
        if status.expected_ready_s is not None:
            card["expected_ready_s"] = round(status.expected_ready_s, 1)
        cards.append(card)
    return cards


@router.get("/models")
async def list_models(caller: CurrentCaller, pools: PoolsDep, plans: PlansDep) -> dict[str, Any]:
    return {"object": "list", "data": await _model_cards(pools, plans, caller)}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, caller: CurrentCaller, pools: PoolsDep, plans: PlansDep) -> dict[str, Any]:
    for card in await _model_cards(pools, plans, caller):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"The model '{model_id}' does not exist or you do not have access to it.",
                   param="model", code="model_not_found")
