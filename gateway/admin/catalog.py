"""Admin routes for plans and the model catalog."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import func, select

from flatfare.storage.models import Account, CatalogModel, Plan
from flatfare.gateway.admin.audit import not_found, page, record, snapshot
from flatfare.gateway.admin.auth import AdminReader, AdminWriter
from flatfare.gateway.admin.catalog_schemas import ModelCreate, ModelPublic, ModelUpdate
from flatfare.gateway.admin.model_options import EngineOptions
from flatfare.gateway.admin.schemas import Page, PlanCreate, PlanPublic, PlanUpdate
from flatfare.gateway.errors import APIError

router = APIRouter()
Limit = Annotated[int, Query(ge=1, le=200)]


# -- plans -------------------------------------------------------------------------------------

@router.get("/plans", response_model=Page[PlanPublic])
async def list_plans(request: Request, _: AdminReader, limit: Limit = 50, after: str | None = None,
                     include_retired: bool = True) -> dict[str, Any]:
    query = select(Plan).order_by(Plan.name).limit(limit + 1)
    if after:
        query = query.where(Plan.name > after)
    if not include_retired:
        query = query.where(Plan.retired.is_(False))
    async with request.app.state.sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda p: p.name)


@router.get("/plans/{name}", response_model=PlanPublic)
async def get_plan(request: Request, name: str, _: AdminReader) -> Plan:
    async with request.app.state.sessions() as session:
        plan = await session.get(Plan, name)
    if plan is None:
        raise not_found("plan", name)
    return plan


@router.post("/plans", response_model=PlanPublic, status_code=201)
async def create_plan(request: Request, body: PlanCreate, admin: AdminWriter) -> Plan:
    defaults = {"daily_limit": None, "price_per_request_micros": 0, "monthly_price_cents": 0, "lane": "standard",
                "max_n": 1, "max_body_bytes": 1_048_576, "max_prompt_tokens": None, "max_inflight": None,
                "timezone": "UTC", "retired": False}
    async with request.app.state.sessions() as session, session.begin():
        if await session.get(Plan, body.name) is not None:
            raise APIError(409, f"A plan named '{body.name}' exists.", param="name", code="plan_exists")
        plan = Plan(**{**defaults, **body.model_dump(exclude_unset=True)})
        session.add(plan)
        await session.flush()
        record(session, admin, "plan.create", "plan", plan.name, None, snapshot(plan))
    return plan


@router.patch("/plans/{name}", response_model=PlanPublic)
async def update_plan(request: Request, name: str, body: PlanUpdate, admin: AdminWriter) -> Plan:
    async with request.app.state.sessions() as session, session.begin():
        plan = await session.get(Plan, name, with_for_update=True)
        if plan is None:
            raise not_found("plan", name)
        before = snapshot(plan)
        for field, value in body.model_dump(exclude_unset=True).items():
            setattr(plan, field, value)
        await session.flush()
        record(session, admin, "plan.update", "plan", name, before, snapshot(plan))
    return plan


@router.delete("/plans/{name}", status_code=204)
async def delete_plan(request: Request, name: str, admin: AdminWriter) -> Response:
    """Delete a plan no account is on; a plan in use can only be retired (PATCH retired=true)."""
    async with request.app.state.sessions() as session, session.begin():
        plan = await session.get(Plan, name, with_for_update=True)
        if plan is None:
            raise not_found("plan", name)
        on_it = await session.scalar(select(func.count()).where(Account.plan == name))
        if on_it:
            raise APIError(409, f"{on_it} account(s) are on the plan '{name}'; move them first, or retire it "
                           "with PATCH {\"retired\": true}.", code="plan_in_use")
        record(session, admin, "plan.delete", "plan", name, snapshot(plan), None)
        await session.delete(plan)
    return Response(status_code=204)


# -- models ------------------------------------------------------------------------------------

def check_tensor_parallel(source: str, options: EngineOptions | None) -> None:
    """For a local model folder, tensor_parallel_size must divide its attention heads."""
    tp = options.tensor_parallel_size if options else None
    config_file = Path(source).expanduser() / "config.json"
    if not tp or tp == 1 or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    if heads and heads % tp:
        raise APIError(422, f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads.",
                       param="engine_options.tensor_parallel_size", code="invalid_value")


async def _public(request: Request, model: CatalogModel) -> ModelPublic:
    return ModelPublic.of(model, await request.app.state.pools.live_workers(model.name))


@router.get("/models", response_model=Page[ModelPublic])
async def list_models(request: Request, _: AdminReader, limit: Limit = 50, after: str | None = None,
                      enabled: bool | None = None) -> dict[str, Any]:
    query = select(CatalogModel).order_by(CatalogModel.name).limit(limit + 1)
    if after:
        query = query.where(CatalogModel.name > after)
    if enabled is not None:
        query = query.where(CatalogModel.enabled.is_(enabled))
    async with request.app.state.sessions() as session:
        rows = list(await session.scalars(query))
    result = page(rows, limit, lambda m: m.name)
    result["data"] = [await _public(request, m) for m in result["data"]]
    return result


@router.get("/models/{name:path}", response_model=ModelPublic)
async def get_model(request: Request, name: str, _: AdminReader) -> ModelPublic:
    async with request.app.state.sessions() as session:
        model = await session.get(CatalogModel, name)
    if model is None:
        raise not_found("model", name)
    return await _public(request, model)


@router.post("/models", response_model=ModelPublic, status_code=201)
async def create_model(request: Request, body: ModelCreate, admin: AdminWriter) -> ModelPublic:
    check_tensor_parallel(body.source, body.engine_options)
    async with request.app.state.sessions() as session, session.begin():
        if await session.get(CatalogModel, body.name) is not None:
            raise APIError(409, f"A model named '{body.name}' exists.", param="name", code="model_exists")
        model = CatalogModel(
            name=body.name, source=body.source,
            engine_options=body.options(), plans=body.plans, pinned=bool(body.pinned), min_workers=body.min_workers or 0,
            enabled=True if body.enabled is None else body.enabled)
        session.add(model)
        await session.flush()
        await session.refresh(model)
        record(session, admin, "model.create", "model", model.name, None, snapshot(model))
    return await _public(request, model)


@router.patch("/models/{name:path}", response_model=ModelPublic)
async def update_model(request: Request, name: str, body: ModelUpdate, admin: AdminWriter) -> ModelPublic:
    async with request.app.state.sessions() as session, session.begin():
        model = await session.get(CatalogModel, name, with_for_update=True)
        if model is None:
            raise not_found("model", name)
        check_tensor_parallel(body.source or model.source, body.engine_options)
        before = snapshot(model)
        changes = body.model_dump(exclude_unset=True)
        changes.pop("trust_remote_code", None)
        if "engine_options" in changes or body.trust_remote_code is not None:
            changes["engine_options"] = body.options(model.engine_options)
        for field, value in changes.items():
            setattr(model, field, value)
        await session.flush()
        record(session, admin, "model.update", "model", name, before, snapshot(model))
    return await _public(request, model)


@router.delete("/models/{name:path}", status_code=204)
async def delete_model(request: Request, name: str, admin: AdminWriter) -> Response:
    async with request.app.state.sessions() as session, session.begin():
        model = await session.get(CatalogModel, name, with_for_update=True)
        if model is None:
            raise not_found("model", name)
        record(session, admin, "model.delete", "model", name, snapshot(model), None)
        await session.delete(model)
    return Response(status_code=204)

