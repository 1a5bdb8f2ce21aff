"""The customer's API keys: list, create (with the per-key limits), revoke, rotate. Every key is looked
up with the customer's own account id in the query: another account's key id is simply not found."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy import select

from flatfare import contract
from flatfare.gateway.admin.schemas import KeyCreate
from flatfare.gateway.console.deps import ConsoleCustomer, ConsoleForm, Customer
from flatfare.gateway.console.models import plan_models
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError
from flatfare.storage.accounts import KeyLimitsUpdate, issue_key
from flatfare.storage.models import ApiKey

router = APIRouter(prefix="/console", include_in_schema=False)

KeyId = Annotated[int, Path(ge=1, le=2**31 - 1)]
PLAYGROUND_KEY_NAME = "Console playground"
MAX_LISTED = 200
# How long a key-issuing form's nonce is remembered as used: longer than anyone keeps a tab to refresh.
FORM_NONCE_TTL_S = 86_400
MAX_NONCE_LEN = 64


async def _keys(request: Request, customer: Customer) -> list[ApiKey]:
    async with request.app.state.sessions() as db:
        return list(await db.scalars(select(ApiKey).where(ApiKey.account_id == customer.account.id,
                                                          ApiKey.revoked_at.is_(None))
                                     .order_by(ApiKey.id.desc()).limit(MAX_LISTED)))


async def _page(request: Request, customer: Customer, *, status_code: int = 200, **context: object) -> Response:
    now = datetime.now(UTC)
    return render(request, "keys.html", {"customer": customer, "keys": await _keys(request, customer), "now": now,
                                         "models": await plan_models(request, customer.account),
                                         "playground_name": PLAYGROUND_KEY_NAME,
                                         "grace_hours": request.app.state.settings.console_rotation_grace_s / 3600,
                                         "form_nonce": secrets.token_urlsafe(16), **context}, status_code=status_code)


async def _first_submission(request: Request, customer: Customer, form: dict[str, str]) -> bool:
    """False when this key-issuing form (its ``form_nonce``) was submitted before in this session: a
    browser re-posting it on refresh, or a double click, must not issue a second key. A form without a
    nonce (a script's own POST) is always a first submission."""
    nonce = form.get("form_nonce", "")[:MAX_NONCE_LEN]
    if not nonce:
        return True
    key = contract.console_form_key(customer.session.id_hash, nonce)
    return bool(await request.app.state.redis.set(key, "1", nx=True, ex=FORM_NONCE_TTL_S))


def _already_submitted() -> Response:
    return RedirectResponse("/console/keys?resubmitted=1", status_code=303)


@router.get("/keys")
async def keys_page(request: Request, customer: ConsoleCustomer) -> Response:
    return await _page(request, customer, resubmitted=request.query_params.get("resubmitted") == "1")


def _limits_from_form(form: dict[str, str], models: list[str]) -> KeyCreate:
    """The form's fields as the admin API's KeyCreate (the same bounds); ValueError with what to fix."""
    chosen = [m for m in models if form.get(f"model:{m}") == "on"]
    days = form.get("expires_days", "").strip()
    fields: dict[str, object] = {"name": form.get("name", "").strip()}
    if days:
        if not days.isdigit() or not 1 <= int(days) <= 3650:
            raise ValueError("Expiry: a number of days from 1 to 3650, or empty for none.")
        fields["expires_at"] = datetime.now(UTC) + timedelta(days=int(days))
    for field, label in (("daily_limit", "Daily cap"), ("max_inflight", "Max in flight")):
        value = form.get(field, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"{label}: a whole number, or empty for the plan's.")
            fields[field] = int(value)
    if chosen:
        fields["allowed_models"] = chosen
    try:
        return KeyCreate.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from exc


@router.post("/keys")
async def create_key(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    models = await plan_models(request, customer.account)
    try:
        limits = _limits_from_form(form, models)
    except ValueError as exc:
        return await _page(request, customer, error=str(exc), status_code=400)
    if not await _first_submission(request, customer, form):
        return _already_submitted()
    async with request.app.state.sessions() as db, db.begin():
        issued = await issue_key(db, customer.account, limits.name, KeyLimitsUpdate(
            expires_at=limits.expires_at, allowed_models=limits.allowed_models, daily_limit=limits.daily_limit,
            max_inflight=limits.max_inflight))
    return await _page(request, customer, created_secret=issued.secret, created_id=issued.key_id,
                       status_code=201)


async def _own_key(db, customer: Customer, key_id: int) -> ApiKey:  # noqa: ANN001 - an AsyncSession
    """The key if it is the customer's and not revoked; 404 otherwise (whose it is, is not said)."""
    key = await db.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.account_id == customer.account.id,
                                               ApiKey.revoked_at.is_(None)).with_for_update())
    if key is None:
        raise APIError(404, f"No API key {key_id} in your account.", code="key_not_found")
    return key


@router.post("/keys/{key_id}/revoke")
async def revoke_key(request: Request, key_id: KeyId, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    async with request.app.state.sessions() as db, db.begin():
        key = await _own_key(db, customer, key_id)
        key.revoked_at = datetime.now(UTC)
    return RedirectResponse("/console/keys", status_code=303)


@router.post("/keys/{key_id}/rotate")
async def rotate_key(request: Request, key_id: KeyId, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """A new key with the same name and limits; the old one keeps working for the grace period."""
    grace = timedelta(seconds=request.app.state.settings.console_rotation_grace_s)
    if not await _first_submission(request, customer, form):
        return _already_submitted()
    async with request.app.state.sessions() as db, db.begin():
        old = await _own_key(db, customer, key_id)
        original_expiry = old.expires_at  # the new key keeps it: rotating must not make a key immortal
        ends = datetime.now(UTC) + grace
        if old.expires_at is None or ends < old.expires_at:
            old.expires_at = ends
        issued = await issue_key(db, customer.account, old.name, KeyLimitsUpdate(
            allowed_models=old.allowed_models, daily_limit=old.daily_limit, max_inflight=old.max_inflight,
            expires_at=original_expiry))
    return await _page(request, customer, created_secret=issued.secret, created_id=issued.key_id, rotated=key_id,
                       status_code=201)
