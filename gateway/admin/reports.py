"""Admin routes for usage (JSON or CSV), the audit log and admin tokens (whose writes are :mod:`services`')."""

from __future__ import annotations

import csv
import io
from datetime import date
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy import func, select

from flatfare.storage.models import AdminToken, AuditEntry, RequestRecord
from flatfare.gateway.admin import services
from flatfare.gateway.admin.paging import IdFilter, RowId, page
from flatfare.gateway.admin.auth import AdminReader, AdminWriter
from flatfare.gateway.admin.schemas import AuditPublic, Page, TokenCreate, TokenCreated, TokenPublic
from flatfare.gateway.app_state import services_of

router = APIRouter()
Limit = Annotated[int, Query(ge=1, le=200)]
_USAGE_COLUMNS = ["day", "account_id", "api_key_id", "model", "requests", "prompt_tokens", "completion_tokens",
                  "amount_micros"]


# ?format=csv answers text/csv: documented beside the JSON body, so clients (and the schema) expect it.
_CSV = {200: {"content": {"text/csv": {"schema": {"type": "string"}}}}}


@router.get("/usage", responses=_CSV)
async def usage(request: Request, _: AdminReader, since: date | None = None, until: date | None = None,
                account_id: IdFilter = None, key_id: IdFilter = None, model: str | None = None,
                format: Literal["json", "csv"] = "json") -> Any:  # noqa: A002 - the query parameter's name
    """Billable requests per day, account, key and model, with totals that match the ledger."""
    query = (select(RequestRecord.quota_day, RequestRecord.account_id, RequestRecord.api_key_id,
                    RequestRecord.model, func.count(), func.coalesce(func.sum(RequestRecord.prompt_tokens), 0),
                    func.coalesce(func.sum(RequestRecord.completion_tokens), 0),
                    func.coalesce(func.sum(RequestRecord.price_micros), 0))
             .where(RequestRecord.billable.is_(True))
             .group_by(RequestRecord.quota_day, RequestRecord.account_id, RequestRecord.api_key_id,
                       RequestRecord.model)
             .order_by(RequestRecord.quota_day, RequestRecord.account_id, RequestRecord.api_key_id,
                       RequestRecord.model))
    if since:
        query = query.where(RequestRecord.quota_day >= since.isoformat())
    if until:
        query = query.where(RequestRecord.quota_day <= until.isoformat())
    if account_id is not None:
        query = query.where(RequestRecord.account_id == account_id)
    if key_id is not None:
        query = query.where(RequestRecord.api_key_id == key_id)
    if model:
        query = query.where(RequestRecord.model == model)
    async with services_of(request).sessions() as session:
        # PostgreSQL sums integers as NUMERIC: bring them back to int.
        rows = [dict(zip(_USAGE_COLUMNS, (*row[:4], *(int(v) for v in row[4:])), strict=True))
                for row in await session.execute(query)]
    if format == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=_USAGE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="flatfare-usage.csv"'})
    totals = {name: sum(r[name] for r in rows) for name in _USAGE_COLUMNS[4:]}
    return {"object": "usage", "data": rows, "totals": totals}


@router.get("/audit", response_model=Page[AuditPublic])
async def audit(request: Request, _: AdminReader, limit: Limit = 50, after: IdFilter = None,
                action: str | None = None, resource_type: str | None = None, resource_id: str | None = None,
                actor_id: IdFilter = None, account_id: IdFilter = None) -> dict[str, Any]:
    """Newest first; ``account_id``: what console members did in that account (its Team page's activity)."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit + 1)
    if after is not None:
        query = query.where(AuditEntry.id < after)
    if action:
        query = query.where(AuditEntry.action == action)
    if resource_type:
        query = query.where(AuditEntry.resource_type == resource_type)
    if resource_id:
        query = query.where(AuditEntry.resource_id == resource_id)
    if actor_id is not None:
        query = query.where(AuditEntry.actor_id == actor_id)
    if account_id is not None:
        query = query.where(AuditEntry.account_id == account_id)
    async with services_of(request).sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda e: e.id)


@router.get("/tokens", response_model=Page[TokenPublic])
async def list_tokens(request: Request, _: AdminReader, limit: Limit = 50, after: IdFilter = None) -> dict:
    query = select(AdminToken).order_by(AdminToken.id).limit(limit + 1)
    if after is not None:
        query = query.where(AdminToken.id > after)
    async with services_of(request).sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda t: t.id)


@router.post("/tokens", response_model=TokenCreated, status_code=201)
async def create_token(request: Request, body: TokenCreate, admin: AdminWriter) -> TokenCreated:
    """A new admin token; no token can grant a scope it does not hold itself."""
    token, secret = await services.create_token(services_of(request).sessions, admin, body)
    return TokenCreated(**TokenPublic.model_validate(token).model_dump(), token=secret)


@router.delete("/tokens/{token_id}", response_model=TokenPublic)
async def revoke_token(request: Request, token_id: RowId, admin: AdminWriter) -> AdminToken:
    return await services.revoke_token(services_of(request).sessions, admin, token_id)
