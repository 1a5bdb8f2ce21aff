"""Admin routes for accounts and their API keys (their writes are :mod:`services`')."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import select

from flatfare.storage.models import Account, AccountMember, ApiKey, ConsoleUser
from flatfare.gateway.admin import services
from flatfare.gateway.admin.paging import IdFilter, RowId, not_found, page
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
    MemberPublic,
    Page,
)
from flatfare.gateway.app_state import services_of

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
    async with services_of(request).sessions() as session:
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda a: a.id)


@router.get("/accounts/{account_id}", response_model=AccountPublic)
async def get_account(request: Request, account_id: RowId, _: AdminReader) -> Account:
    async with services_of(request).sessions() as session:
        account = await session.get(Account, account_id)
    if account is None:
        raise not_found("account", account_id)
    return account


@router.post("/accounts", response_model=AccountPublic, status_code=201)
async def create_account(request: Request, body: AccountCreate, admin: AdminWriter) -> Account:
    return await services.create_account(services_of(request).sessions, admin, body)


@router.patch("/accounts/{account_id}", response_model=AccountPublic)
async def update_account(request: Request, account_id: RowId, body: AccountUpdate, admin: AdminWriter) -> Account:
    """Suspend or reactivate, change the plan, set enterprise limits or a dedicated pool."""
    return await services.update_account(services_of(request).sessions, admin, account_id, body)


@router.get("/accounts/{account_id}/members", response_model=Page[MemberPublic])
async def list_members(request: Request, account_id: RowId, _: AdminReader, limit: Limit = 50,
                       after: IdFilter = None) -> dict[str, Any]:
    """The account's console members and their roles, by user id."""
    query = (select(AccountMember.user_id, ConsoleUser.email, AccountMember.role,
                    AccountMember.created_at.label("since"))
             .join(ConsoleUser, ConsoleUser.id == AccountMember.user_id)
             .where(AccountMember.account_id == account_id).order_by(AccountMember.user_id).limit(limit + 1))
    if after is not None:
        query = query.where(AccountMember.user_id > after)
    async with services_of(request).sessions() as session:
        if await session.get(Account, account_id) is None:
            raise not_found("account", account_id)
        rows = list(await session.execute(query))
    return page(rows, limit, lambda m: m.user_id)


@router.get("/accounts/{account_id}/keys", response_model=Page[KeyPublic])
async def list_keys(request: Request, account_id: RowId, _: AdminReader, limit: Limit = 50,
                    after: IdFilter = None, include_revoked: bool = True) -> dict[str, Any]:
    query = select(ApiKey).where(ApiKey.account_id == account_id).order_by(ApiKey.id).limit(limit + 1)
    if after is not None:
        query = query.where(ApiKey.id > after)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    async with services_of(request).sessions() as session:
        if await session.get(Account, account_id) is None:
            raise not_found("account", account_id)
        rows = list(await session.scalars(query))
    return page(rows, limit, lambda k: k.id)


@router.post("/accounts/{account_id}/keys", response_model=KeyCreated, status_code=201)
async def create_key(request: Request, account_id: RowId, body: KeyCreate, admin: AdminWriter) -> KeyCreated:
    key, secret = await services.create_key(services_of(request).sessions, admin, account_id, body)
    return KeyCreated(**KeyPublic.model_validate(key).model_dump(), key=secret)


@router.patch("/keys/{key_id}", response_model=KeyPublic)
async def update_key(request: Request, key_id: RowId, body: KeyUpdate, admin: AdminWriter) -> ApiKey:
    """Rename a key, set or clear its expiry, its model list, its daily and in-flight caps; every gateway process
    applies the change within its auth cache's lifetime (< 1 s)."""
    return await services.update_key(services_of(request).sessions, admin, key_id, body)


@router.delete("/keys/{key_id}", response_model=KeyPublic)
async def revoke_key(request: Request, key_id: RowId, admin: AdminWriter) -> ApiKey:
    """Revoke at once: every gateway process refuses it within its auth cache's lifetime (< 1 s)."""
    return await services.revoke_key(services_of(request).sessions, admin, key_id)


@router.post("/keys/{key_id}/rotate", response_model=KeyCreated, status_code=201)
async def rotate_key(request: Request, key_id: RowId, body: KeyRotate, admin: AdminWriter) -> KeyCreated:
    """A new key for the same account; the old one keeps working for ``grace_seconds``."""
    key, secret = await services.rotate_key(services_of(request).sessions, admin, key_id, body)
    return KeyCreated(**KeyPublic.model_validate(key).model_dump(), key=secret)
