"""Admin routes for accounts (their writes are :mod:`services`') and their API keys."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from flatfare.storage.accounts import KeyLimitsUpdate, issue_key
from flatfare.storage.models import Account, ApiKey
from flatfare.gateway.admin import services
from flatfare.gateway.admin.audit import IdFilter, RowId, not_found, page, record, snapshot
from flatfare.gateway.admin.auth import AdminReader, AdminWriter
from flatfare.gateway.admin.schemas import (
    AccountCreate,
    AccountPublic,
    AccountUpdate,
    KeyCreate,
    KeyCreated,
    KeyPublic,
    KeyRotate,
    KeyUpdate,
    Page,
)
from flatfare.gateway.errors import APIError

router = APIRouter()
Limit = Annotated[int, Query(ge=1, le=200)]


@router.get("/accounts", response_model=Page[AccountPublic])
async def list_accounts(request: Request, _: AdminReader, limit: Limit = 50, after: IdFilter = None,
                        plan: str | None = None, status: str | None = None,
                        name_contains: str | None = None) -> dict[str, Any]:
    query = select(Account).order_by(Account.id).limit(limit + 1)
    if after is not None:
        query = query.where(Account.id > after)
    if plan:
        query = query.where(Account.plan == plan)
    if status:
        query = query.where(Account.status == status)
    if name_contains:
        query = query.where(Account.name.contains(name_contains, autoescape=True))
    async with request.app.state.sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda a: a.id)


@router.get("/accounts/{account_id}", response_model=AccountPublic)
async def get_account(request: Request, account_id: RowId, _: AdminReader) -> Account:
    async with request.app.state.sessions() as session:
        account = await session.get(Account, account_id)
    if account is None:
        raise not_found("account", account_id)
    return account


@router.post("/accounts", response_model=AccountPublic, status_code=201)
async def create_account(request: Request, body: AccountCreate, admin: AdminWriter) -> Account:
    return await services.create_account(request.app.state.sessions, admin, body)


@router.patch("/accounts/{account_id}", response_model=AccountPublic)
async def update_account(request: Request, account_id: RowId, body: AccountUpdate, admin: AdminWriter) -> Account:
    """Suspend or reactivate, change the plan, set enterprise limits or a dedicated pool."""
    return await services.update_account(request.app.state.sessions, admin, account_id, body)


@router.get("/accounts/{account_id}/keys", response_model=Page[KeyPublic])
async def list_keys(request: Request, account_id: RowId, _: AdminReader, limit: Limit = 50,
                    after: IdFilter = None, include_revoked: bool = True) -> dict[str, Any]:
    query = select(ApiKey).where(ApiKey.account_id == account_id).order_by(ApiKey.id).limit(limit + 1)
    if after is not None:
        query = query.where(ApiKey.id > after)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    async with request.app.state.sessions() as session:
        if await session.get(Account, account_id) is None:
            raise not_found("account", account_id)
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda k: k.id)


@router.post("/accounts/{account_id}/keys", response_model=KeyCreated, status_code=201)
async def create_key(request: Request, account_id: RowId, body: KeyCreate, admin: AdminWriter) -> KeyCreated:
    async with request.app.state.sessions() as session, session.begin():
        account = await session.get(Account, account_id)
        if account is None:
            raise not_found("account", account_id)
        limits = KeyLimitsUpdate(expires_at=body.expires_at, allowed_models=body.allowed_models,
                                 daily_limit=body.daily_limit, max_inflight=body.max_inflight)
        issued = await issue_key(session, account, body.name, limits)
        key = await session.get(ApiKey, issued.key_id)
        await session.refresh(key)
        record(session, admin, "key.create", "key", key.id, None, snapshot(key))
    return KeyCreated(**KeyPublic.model_validate(key).model_dump(), key=issued.secret)


@router.patch("/keys/{key_id}", response_model=KeyPublic)
async def update_key(request: Request, key_id: RowId, body: KeyUpdate, admin: AdminWriter) -> ApiKey:
    """Rename a key, set or clear its expiry, its model list, its daily and in-flight caps; every gateway process
    applies the change within its auth cache's lifetime (< 1 s)."""
    async with request.app.state.sessions() as session, session.begin():
        key = await session.get(ApiKey, key_id, with_for_update=True)
        if key is None:
            raise not_found("key", key_id)
        before = snapshot(key)
        KeyLimitsUpdate(**body.model_dump(exclude_unset=True)).apply(key)
        await session.flush()
        record(session, admin, "key.update", "key", key_id, before, snapshot(key))
    return key


@router.delete("/keys/{key_id}", response_model=KeyPublic)
async def revoke_key(request: Request, key_id: RowId, admin: AdminWriter) -> ApiKey:
    """Revoke at once: every gateway process refuses it within its auth cache's lifetime (< 1 s)."""
    async with request.app.state.sessions() as session, session.begin():
        key = await session.get(ApiKey, key_id, with_for_update=True)
        if key is None:
            raise not_found("key", key_id)
        before = snapshot(key)
        if key.revoked_at is None:
            key.revoked_at = datetime.now(UTC)
        await session.flush()
        record(session, admin, "key.revoke", "key", key_id, before, snapshot(key))
    return key


@router.post("/keys/{key_id}/rotate", response_model=KeyCreated, status_code=201)
async def rotate_key(request: Request, key_id: RowId, body: KeyRotate, admin: AdminWriter) -> KeyCreated:
    """A new key for the same account; the old one keeps working for ``grace_seconds``."""
    async with request.app.state.sessions() as session, session.begin():
        old = await session.get(ApiKey, key_id, with_for_update=True)
        if old is None:
            raise not_found("key", key_id)
        if old.revoked_at is not None:
            raise APIError(409, "A revoked key cannot be rotated; create a new one.", code="key_revoked")
        before = snapshot(old)
        grace_ends = datetime.now(UTC) + timedelta(seconds=body.grace_seconds)
        if old.expires_at is None or grace_ends < old.expires_at:
            old.expires_at = grace_ends
        account = await session.get(Account, old.account_id)
        # The new key keeps the old one's limits: a rotation must not widen what the key may do.
        issued = await issue_key(session, account, body.name if body.name is not None else old.name,
                                 KeyLimitsUpdate(allowed_models=old.allowed_models, daily_limit=old.daily_limit,
                                                 max_inflight=old.max_inflight))
        new = await session.get(ApiKey, issued.key_id)
        await session.refresh(new)
        record(session, admin, "key.rotate", "key", key_id, before, {**snapshot(old), "replaced_by": new.id})
        record(session, admin, "key.create", "key", new.id, None, snapshot(new))
    return KeyCreated(**KeyPublic.model_validate(new).model_dump(), key=issued.secret)
