"""The customer's API keys: list (with the member who made each), create (with the per-key limits),
revoke, rotate; for members whose role opens keys (:mod:`flatfare.gateway.roles`), each write in the
account's audit log. Every key is looked up with the customer's own account id in the query: another
account's key id is simply not found."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy import select

from flatfare.gateway.console.shared_key_notice import shared_keys_of
from flatfare.gateway.console import keyspace
from flatfare.gateway.admin.schemas import KeyCreate
from flatfare.gateway.console.deps import ConsoleForm, Customer, KeysMember
from flatfare.gateway.console.plan_models import plan_models
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError
from flatfare.gateway.console.members import actor_of
from flatfare.storage.accounts import KeyLimitsUpdate, issue_key, revoke, rotate
from flatfare.storage.audit import record, snapshot
from flatfare.storage.models import ApiKey, ConsoleUser
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)

KeyId = Annotated[int, Path(ge=1, le=2**31 - 1)]
PLAYGROUND_KEY_NAME = "Console playground"
MAX_LISTED = 200
# How long a key-issuing form's nonce is remembered as used: longer than anyone keeps a tab to refresh.
FORM_NONCE_TTL_S = 86_400
MAX_NONCE_LEN = 64
# api_keys.name's length.
NAME_LENGTH = 128
REVOKED = "The key was revoked: requests made with it are refused from now on."


async def _keys(request: Request, customer: Customer) -> list[tuple[ApiKey, str | None]]:
    """The account's live keys, newest first, each with the email of the member who made it (None: an
    operator, or the console's playground)."""
    async with services_of(request).sessions() as db:
        rows = await db.execute(select(ApiKey, ConsoleUser.email)
                                .outerjoin(ConsoleUser, ConsoleUser.id == ApiKey.created_by_user_id)
                                .where(ApiKey.account_id == customer.account.id, ApiKey.revoked_at.is_(None))
                                .order_by(ApiKey.id.desc()).limit(MAX_LISTED))
        return [(key, email) for key, email in rows]


def _audit(db, customer: Customer, action: str, key: ApiKey, before: dict | None,  # noqa: ANN001 - an AsyncSession
           **after: object) -> None:
    """The key's change in the account's audit log, as the member's."""
    record(db, actor_of(customer.user), action, "key", key.id, before, {**snapshot(key), **after},
           account_id=customer.account.id)


async def _page(request: Request, customer: Customer, *, status_code: int = 200, **context: object) -> Response:
    now = datetime.now(UTC)
    return render(request, "keys.html", {"customer": customer, "keys": await _keys(request, customer), "now": now,
                                         "models": await plan_models(request, customer.account),
                                         "playground_name": PLAYGROUND_KEY_NAME,
                                         "grace_hours": services_of(request).settings.console_rotation_grace_s / 3600,
                                         "form_nonce": secrets.token_urlsafe(16),
                                         "shared_key_warnings": await shared_keys_of(services_of(request),
                                                                                     customer.account.id),
                                         **context}, status_code=status_code)


async def _first_submission(request: Request, customer: Customer, form: dict[str, str]) -> bool:
    """False when this key-issuing form (its ``form_nonce``) was submitted before in this session: a
    browser re-posting it on refresh, or a double click, must not issue a second key. A form without a
    nonce (a script's own POST) is always a first submission."""
    nonce = form.get("form_nonce", "")[:MAX_NONCE_LEN]
    if not nonce:
        return True
    key = keyspace.console_form_key(customer.session.id_hash, nonce)
    return bool(await services_of(request).redis.set(key, "1", nx=True, ex=FORM_NONCE_TTL_S))


def _already_submitted() -> Response:
    return RedirectResponse("/console/keys?resubmitted=1", status_code=303)


@router.get("/keys")
async def keys_page(request: Request, customer: KeysMember) -> Response:
    revoked = request.query_params.get("done") == "revoked"
    return await _page(request, customer, resubmitted=request.query_params.get("resubmitted") == "1",
                       flash=REVOKED if revoked else "")


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
async def create_key(request: Request, customer: KeysMember, form: ConsoleForm) -> Response:
    models = await plan_models(request, customer.account)
    try:
        limits = _limits_from_form(form, models)
    except ValueError as exc:
        return await _page(request, customer, error=str(exc), status_code=400)
    if not await _first_submission(request, customer, form):
        return _already_submitted()
    async with services_of(request).sessions() as db, db.begin():
        issued = await issue_key(db, customer.account, limits.name, KeyLimitsUpdate(
            expires_at=limits.expires_at, allowed_models=limits.allowed_models, daily_limit=limits.daily_limit,
            max_inflight=limits.max_inflight), created_by_user_id=customer.user.id)
        _audit(db, customer, "key.create", await db.get(ApiKey, issued.key_id), None)
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
async def revoke_key(request: Request, key_id: KeyId, customer: KeysMember, form: ConsoleForm) -> Response:
    async with services_of(request).sessions() as db, db.begin():
        key = await _own_key(db, customer, key_id)
        before = snapshot(key)
        revoke(key)
        _audit(db, customer, "key.revoke", key, before)
    return RedirectResponse("/console/keys?done=revoked", status_code=303)


def rotated_name(name: str, now: datetime) -> str:
    """The name the outgoing key of a rotation takes, so that it reads apart from its replacement (which
    keeps the name: code and the Playground find their key by it): "backend (rotated 2026-12-06)"."""
    suffix = f" (rotated {now:%Y-%m-%d})"
    return (name or "Unnamed")[: NAME_LENGTH - len(suffix)] + suffix


@router.post("/keys/{key_id}/rotate")
async def rotate_key(request: Request, key_id: KeyId, customer: KeysMember, form: ConsoleForm) -> Response:
    """A new key with the same name and limits; the old one keeps working for the grace period."""
    grace = timedelta(seconds=services_of(request).settings.console_rotation_grace_s)
    if not await _first_submission(request, customer, form):
        return _already_submitted()
    async with services_of(request).sessions() as db, db.begin():
        old = await _own_key(db, customer, key_id)
        before = snapshot(old)
        issued = await rotate(db, old, grace, old.name)
        old.name = rotated_as = rotated_name(old.name, datetime.now(UTC))
        _audit(db, customer, "key.rotate", old, before, replaced_by=issued.key_id)
    return await _page(request, customer, created_secret=issued.secret, created_id=issued.key_id, rotated=key_id,
                       rotated_as=rotated_as, status_code=201)
