"""The admin writes, as plain functions of a session factory and an :class:`Admin`: the admin API's routes
and the admin console call these same ones, so a plan, an account, a key or an admin token changes one
way only (the model catalog's are :mod:`.catalog_services`). Every one goes through :func:`writing`,
which checks the ``admin:write`` scope (the one place it is checked), and records its audit entry in
the transaction that makes the change (:func:`audited` for a change to a row, :func:`created` for a new
one). A plan change goes through billing's one rule set (:mod:`flatfare.billing.plan_change`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.plan_change import PlanChangeRefused, change_plan, ensure_account
from flatfare.storage.accounts import KeyLimitsUpdate, issue_admin_token, issue_key, revoke, rotate
from flatfare.storage.audit import record, snapshot
from flatfare.storage.models import Account, AdminToken, ApiKey, Base, Plan
from flatfare.gateway.admin.paging import not_found
from flatfare.gateway.admin.auth import Admin, Scope
from flatfare.gateway.admin.schemas import (AccountCreate, AccountUpdate, KeyCreate, KeyRotate, KeyUpdate,
                                            PlanCreate, PlanUpdate, TokenCreate)
from flatfare.gateway.errors import APIError

Sessions = async_sessionmaker[AsyncSession]

_PLAN_DEFAULTS: dict[str, Any] = {
    "daily_limit": None, "price_per_request_micros": 0, "monthly_price_cents": 0, "lane": "standard",
    "max_n": 1, "max_body_bytes": 1_048_576, "max_prompt_tokens": None, "max_inflight": None,
    "timezone": "UTC", "retired": False}


# -- the audited write -------------------------------------------------------------------------

def require_write(admin: Admin) -> None:
    """The ``admin:write`` scope, which every admin write needs (403 ``insufficient_scope``). The one
    definition: :func:`writing` checks it, and a console form checks it before reading the form."""
    if Scope.WRITE.value not in admin.scopes:
        raise APIError(403, "This admin token is read-only: it lacks the 'admin:write' scope.",
                       code="insufficient_scope")


@asynccontextmanager
async def writing(sessions: Sessions, admin: Admin) -> AsyncIterator[AsyncSession]:
    """One admin write's transaction, for an admin whose scopes include ``admin:write``."""
    require_write(admin)
    async with sessions() as session, session.begin():
        yield session


@dataclass
class Change:
    """A row being changed under :func:`audited`: what it was, and what the entry adds or whether it goes."""

    session: AsyncSession
    row: Any
    before: dict[str, Any] | None
    # Recorded beside the row's columns after the change (a rotation names the key that replaced it).
    extra: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False


@asynccontextmanager
async def audited(sessions: Sessions, admin: Admin, action: str, kind: str, model: type[Base],
                  key: object) -> AsyncIterator[Change]:
    """The row ``key`` of ``model`` locked (404 naming the ``kind`` if there is none), changed by the
    caller, and recorded before and after, all in one transaction. Set ``deleted`` to delete it."""
    async with writing(sessions, admin) as session:
        row = await session.get(model, key, with_for_update=True)
        if row is None:
            raise not_found(kind, key)
        change = Change(session, row, snapshot(row))
        yield change
        await session.flush()
        after = None if change.deleted else {**(snapshot(row) or {}), **change.extra}
        record(session, admin.actor, action, kind, key, change.before, after)
        if change.deleted:
            await session.delete(row)


async def created(session: AsyncSession, admin: Admin, action: str, kind: str, row: Base,
                  resource_id: object) -> None:
    """Record a new row (added to ``session`` under :func:`writing`)."""
    await session.flush()
    await session.refresh(row)
    record(session, admin.actor, action, kind, resource_id, None, snapshot(row))


def _plan_refused(exc: PlanChangeRefused) -> APIError:
    return APIError(422, str(exc), param="plan", code=exc.code)


# -- plans -------------------------------------------------------------------------------------

async def create_plan(sessions: Sessions, admin: Admin, body: PlanCreate) -> Plan:
    async with writing(sessions, admin) as session:
        if await session.get(Plan, body.name) is not None:
            raise APIError(409, f"A plan named '{body.name}' exists.", param="name", code="plan_exists")
        plan = Plan(**{**_PLAN_DEFAULTS, **body.model_dump(exclude_unset=True)})
        session.add(plan)
        await created(session, admin, "plan.create", "plan", plan, plan.name)
    return plan


async def update_plan(sessions: Sessions, admin: Admin, name: str, body: PlanUpdate) -> Plan:
    """Apply the fields ``body`` sets; every gateway process sees them within its plan cache's lifetime."""
    async with audited(sessions, admin, "plan.update", "plan", Plan, name) as change:
        for field_name, value in body.model_dump(exclude_unset=True).items():
            setattr(change.row, field_name, value)
    return change.row


async def delete_plan(sessions: Sessions, admin: Admin, name: str) -> None:
    """Delete a plan no account is on; a plan in use can only be retired."""
    async with audited(sessions, admin, "plan.delete", "plan", Plan, name) as change:
        on_it = await change.session.scalar(select(func.count()).where(Account.plan == name))
        if on_it:
            raise APIError(409, f"{on_it} account(s) are on the plan '{name}'; move them first, or retire it "
                           "with PATCH {\"retired\": true}.", code="plan_in_use")
        change.deleted = True


# -- accounts ----------------------------------------------------------------------------------

async def create_account(sessions: Sessions, admin: Admin, body: AccountCreate) -> Account:
    async with writing(sessions, admin) as session:
        if await session.scalar(select(Account).where(Account.name == body.name)) is not None:
            raise APIError(409, f"An account named '{body.name}' exists.", param="name", code="account_exists")
        try:
            account = await ensure_account(session, body.name, body.plan)
        except PlanChangeRefused as exc:
            raise _plan_refused(exc) from exc
        account.daily_limit_override = body.daily_limit_override
        account.unlimited = body.unlimited
        account.dedicated_pool = body.dedicated_pool
        account.max_inflight_override = body.max_inflight_override
        await created(session, admin, "account.create", "account", account, account.id)
    return account


async def update_account(sessions: Sessions, admin: Admin, account_id: int, body: AccountUpdate) -> Account:
    """Suspend or reactivate, change the plan (billing's rule: a trial's end is set from the moment it
    starts), set enterprise limits or a dedicated pool."""
    async with audited(sessions, admin, "account.update", "account", Account, account_id) as change:
        account = change.row
        changes = body.model_dump(exclude_unset=True)
        plan = changes.pop("plan", None)
        if plan is not None and plan != account.plan:
            try:
                await change_plan(change.session, account, plan)
            except PlanChangeRefused as exc:
                raise _plan_refused(exc) from exc
        for field_name, value in changes.items():
            setattr(account, field_name, value)
    return account


# -- API keys ----------------------------------------------------------------------------------

async def create_key(sessions: Sessions, admin: Admin, account_id: int, body: KeyCreate) -> tuple[ApiKey, str]:
    """A new key of the account, with its own limits: the row and its secret (shown once)."""
    async with writing(sessions, admin) as session:
        account = await session.get(Account, account_id)
        if account is None:
            raise not_found("account", account_id)
        limits = KeyLimitsUpdate(expires_at=body.expires_at, allowed_models=body.allowed_models,
                                 daily_limit=body.daily_limit, max_inflight=body.max_inflight)
        issued = await issue_key(session, account, body.name, limits)
        key = await session.get(ApiKey, issued.key_id)
        assert key is not None
        await created(session, admin, "key.create", "key", key, key.id)
    return key, issued.secret


async def update_key(sessions: Sessions, admin: Admin, key_id: int, body: KeyUpdate) -> ApiKey:
    """Rename a key, set or clear its expiry, its model list, its daily and in-flight caps."""
    async with audited(sessions, admin, "key.update", "key", ApiKey, key_id) as change:
        KeyLimitsUpdate(**body.model_dump(exclude_unset=True)).apply(change.row)
    return change.row


async def revoke_key(sessions: Sessions, admin: Admin, key_id: int) -> ApiKey:
    async with audited(sessions, admin, "key.revoke", "key", ApiKey, key_id) as change:
        revoke(change.row)
    return change.row


async def rotate_key(sessions: Sessions, admin: Admin, key_id: int, body: KeyRotate) -> tuple[ApiKey, str]:
    """A new key for the same account (see :func:`flatfare.storage.accounts.rotate`)."""
    async with audited(sessions, admin, "key.rotate", "key", ApiKey, key_id) as change:
        if change.row.revoked_at is not None:
            raise APIError(409, "A revoked key cannot be rotated; create a new one.", code="key_revoked")
        issued = await rotate(change.session, change.row, timedelta(seconds=body.grace_seconds), body.name)
        new = await change.session.get(ApiKey, issued.key_id)
        assert new is not None
        await created(change.session, admin, "key.create", "key", new, new.id)
        change.extra["replaced_by"] = new.id
    return new, issued.secret


# -- admin tokens ------------------------------------------------------------------------------

async def create_token(sessions: Sessions, admin: Admin, body: TokenCreate) -> tuple[AdminToken, str]:
    """A new admin token; no token can grant a scope it does not hold itself."""
    above = set(body.scopes) - admin.scopes
    if above:
        raise APIError(403, f"You cannot grant {', '.join(sorted(above))}: your token lacks it.", param="scopes",
                       code="insufficient_scope")
    async with writing(sessions, admin) as session:
        token, secret = await issue_admin_token(session, body.name, list(body.scopes), admin.token_id)
        await created(session, admin, "token.create", "token", token, token.id)
    return token, secret


async def revoke_token(sessions: Sessions, admin: Admin, token_id: int) -> AdminToken:
    async with audited(sessions, admin, "token.revoke", "token", AdminToken, token_id) as change:
        revoke(change.row)
    return change.row
