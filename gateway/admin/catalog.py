"""Admin routes for plans and the model catalog; their writes are :mod:`services`' and :mod:`catalog_services`'."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select

from flatfare.storage.models import CatalogModel, Plan
from flatfare.gateway.admin import catalog_services, services
from flatfare.gateway.admin.paging import not_found, page
from flatfare.gateway.admin.auth import AdminReader, AdminWriter
from flatfare.gateway.admin.catalog_schemas import ModelCreate, ModelPublic, ModelUpdate
from flatfare.gateway.admin.schemas import Page, PlanCreate, PlanPublic, PlanUpdate
from flatfare.gateway.app_state import services_of

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
    async with services_of(request).sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda p: p.name)


@router.get("/plans/{name}", response_model=PlanPublic)
async def get_plan(request: Request, name: str, _: AdminReader) -> Plan:
    async with services_of(request).sessions() as session:
        plan = await session.get(Plan, name)
    if plan is None:
        raise not_found("plan", name)
    return plan


@router.post("/plans", response_model=PlanPublic, status_code=201)
async def create_plan(request: Request, body: PlanCreate, admin: AdminWriter) -> Plan:
    return await services.create_plan(services_of(request).sessions, admin, body)


@router.patch("/plans/{name}", response_model=PlanPublic)
async def update_plan(request: Request, name: str, body: PlanUpdate, admin: AdminWriter) -> Plan:
    return await services.update_plan(services_of(request).sessions, admin, name, body)


@router.delete("/plans/{name}", status_code=204)
async def delete_plan(request: Request, name: str, admin: AdminWriter) -> Response:
    """Delete a plan no account is on; a plan in use can only be retired (PATCH retired=true)."""
    await services.delete_plan(services_of(request).sessions, admin, name)
    return Response(status_code=204)


# -- models ------------------------------------------------------------------------------------

async def _public(request: Request, model: CatalogModel) -> ModelPublic:
    # A LoRA variant is served by its base model's pool, with the base's engines.
    base = None
    if model.base_model:
        async with services_of(request).sessions() as session:
            base = await session.get(CatalogModel, model.base_model)
    pools = services_of(request).pools
    return ModelPublic.of(model, await pools.live_workers(model.base_model or model.name), base, await pools.fleets())


@router.get("/models", response_model=Page[ModelPublic])
async def list_models(request: Request, _: AdminReader, limit: Limit = 50, after: str | None = None,
                      enabled: bool | None = None) -> dict[str, Any]:
    query = select(CatalogModel).order_by(CatalogModel.name).limit(limit + 1)
    if after:
        query = query.where(CatalogModel.name > after)
    if enabled is not None:
        query = query.where(CatalogModel.enabled.is_(enabled))
    async with services_of(request).sessions() as session:
        rows = list(await session.scalars(query))
    result = page(rows, limit, lambda m: m.name)
    result["data"] = [await _public(request, m) for m in result["data"]]
    return result


@router.get("/models/{name:path}", response_model=ModelPublic)
async def get_model(request: Request, name: str, _: AdminReader) -> ModelPublic:
    async with services_of(request).sessions() as session:
        model = await session.get(CatalogModel, name)
    if model is None:
        raise not_found("model", name)
    return await _public(request, model)


@router.post("/models", response_model=ModelPublic, status_code=201)
async def create_model(request: Request, body: ModelCreate, admin: AdminWriter) -> ModelPublic:
    return await _public(request, await catalog_services.create_model(services_of(request).sessions, admin, body))


@router.patch("/models/{name:path}", response_model=ModelPublic)
async def update_model(request: Request, name: str, body: ModelUpdate, admin: AdminWriter) -> ModelPublic:
    return await _public(request, await catalog_services.update_model(services_of(request).sessions, admin, name, body))


@router.delete("/models/{name:path}", status_code=204)
async def delete_model(request: Request, name: str, admin: AdminWriter) -> Response:
    """Delete a catalog entry; a base model with variants is refused (409 naming them)."""
    await catalog_services.delete_model(services_of(request).sessions, admin, name)
    return Response(status_code=204)
