"""The admin console under ``/console/admin``: accounts, plans, the model catalog's live state, platform
usage and the audit log. Pages read through :mod:`.admin_data`; every write calls the admin API's own
services (:mod:`flatfare.gateway.admin.services`), so it is validated, applied and audited exactly as
``PATCH /admin/v1/...`` would be. A write needs the ``admin:write`` scope and the session's CSRF token."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy import func, select

from flatfare.gateway.admin import catalog_services, services
from flatfare.gateway.admin.paging import IdFilter, RowId, not_found
from flatfare.gateway.admin.auth import Admin
from flatfare.gateway.admin.catalog_schemas import ModelUpdate
from flatfare.gateway.admin.schemas import AccountUpdate
from flatfare.gateway.console.shared_key_notice import shared_keys_of
from flatfare.gateway.console import admin_data as data
from flatfare.gateway.console import members
from flatfare.gateway.console.admin_forms import PLAN_FIELDS, plan_values, read_plan_form
from flatfare.gateway.console.deps import ConsoleAdmin, ConsoleForm
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError
from flatfare.storage.models import Account, AuditEntry, Plan
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console/admin", include_in_schema=False)

Search = Annotated[str, Query(max_length=data.MAX_QUERY_CHARS)]
Action = Annotated[str, Query(max_length=64)]
Days = Annotated[int, Query(ge=1, le=366)]
# Messages a redirect may ask for by name (never free text from the URL).
FLASHES = {"plan": "The account's plan was changed.", "suspended": "The account was suspended.",
           "active": "The account is active again.", "saved": "Saved.", "unchanged": "Nothing changed."}
USAGE_RANGES = (7, 30, 90)


def _on_the_form(exc: APIError) -> bool:
    """An admin service's refusal the form shows beside its fields; a missing row (404) or a read-only
    admin (403, the services' scope check) is answered as such instead."""
    return exc.status not in (403, 404)


def _htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def _flash(request: Request) -> dict[str, str]:
    message = FLASHES.get(request.query_params.get("done", ""))
    return {"flash": message, "flash_kind": "ok"} if message else {}


def money(micros: int | None) -> str:
    """Dollars from micro-dollars: cents once it is a dollar or more, else down to the micro-dollar."""
    dollars = (micros or 0) / 1_000_000
    if dollars >= 1 or dollars == 0:
        return f"${dollars:,.2f}"
    return f"${dollars:,.6f}".rstrip("0")


def num(value: int | None, none: str = "—") -> str:
    return none if value is None else f"{value:,}"


def secs(value: float | None, none: str = "—") -> str:
    """A latency: milliseconds under a second, else seconds."""
    if value is None:
        return none
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _page(request: Request, name: str, context: dict[str, Any], *, status_code: int = 200) -> Response:
    helpers = {"money": money, "num": num, "secs": secs, "nav": "admin"}
    return render(request, name, {**helpers, **_flash(request), **context}, status_code=status_code)


def _chart(days: list[Any]) -> dict[str, Any]:
    """What static/admin.js draws: requests (bars) and billable revenue in dollars (a line) per day."""
    return {"labels": [d.day[5:] for d in days], "requests": [d.requests for d in days],
            "billable": [d.billable_requests for d in days],
            "revenue": [round(d.price_micros / 1_000_000, 6) for d in days]}


# -- dashboard ---------------------------------------------------------------------------------

@router.get("")
async def dashboard(request: Request, admin: ConsoleAdmin) -> Response:
    state = services_of(request)
    async with state.sessions() as session:
        counts = await data.platform_counts(session)
        recent, _ = await data.audit_page(session, limit=6)
    days = await data.platform_usage(state, 14)
    models, redis_up = await data.model_rows(state)
    return _page(request, "admin/dashboard.html", {
        "admin": admin, "counts": counts, "today": days[-1], "shared_keys": await shared_keys_of(state),
        "chart": _chart(days), "models": models, "redis_up": redis_up, "plans": await data.plan_rows(state),
        "recent": [{"entry": e, "label": label(e)} for e in recent]})


# -- accounts ----------------------------------------------------------------------------------

@router.get("/accounts")
async def accounts(request: Request, admin: ConsoleAdmin, q: Search = "", after: IdFilter = None) -> Response:
    async with services_of(request).sessions() as session:
        rows, next_after = await data.find_accounts(session, q, after=after)
        emails = await data.emails_of(session, [a.id for a in rows])
        key_counts = await data.live_key_counts(session, [a.id for a in rows])
    context = {"rows": rows, "emails": emails, "key_counts": key_counts, "q": q, "next_after": next_after}
    if _htmx(request) and request.headers.get("hx-target") == "account-rows":
        return _page(request, "admin/_account_rows.html", context)
    return _page(request, "admin/accounts.html", context)


async def _account_page(request: Request, account_id: int, *, error: str = "", notice: str = "",
                        status_code: int = 200, partial: bool = False) -> Response:
    view = await data.account_view(services_of(request), account_id)
    if view is None:
        raise not_found("account", account_id)
    async with services_of(request).sessions() as db:
        team = await members.members(db, account_id)
    context = {"view": view, "chart": _chart(view.history), "form_error": error, "form_notice": notice,
               "now": datetime.now(UTC), "team": team, "member_emails": {m.user_id: m.email for m in team},
               "shared_keys": {k.key_id: k for k in await shared_keys_of(services_of(request), account_id)}}
    return _page(request, "admin/_account_summary.html" if partial else "admin/account.html", context,
                 status_code=status_code)


@router.get("/accounts/{account_id}")
async def account(request: Request, account_id: RowId, admin: ConsoleAdmin) -> Response:
    return await _account_page(request, account_id)


async def _update_account(request: Request, admin: Admin, account_id: int, fields: dict[str, Any],
                          done: str) -> Response:
    services.require_write(admin)  # a read-only admin hears so before the form is read
    try:
        await services.update_account(services_of(request).sessions, admin, account_id, AccountUpdate(**fields))
    except ValidationError as exc:
        return await _account_page(request, account_id, error=exc.errors()[0]["msg"], partial=_htmx(request),
                                   status_code=200 if _htmx(request) else 422)
    except APIError as exc:
        if not _on_the_form(exc):
            raise
        return await _account_page(request, account_id, error=exc.message, partial=_htmx(request),
                                   status_code=200 if _htmx(request) else exc.status)
    if _htmx(request):
        return await _account_page(request, account_id, notice=FLASHES[done], partial=True)
    return RedirectResponse(f"/console/admin/accounts/{account_id}?done={done}", status_code=303)


@router.post("/accounts/{account_id}/plan")
async def change_plan(request: Request, account_id: RowId, admin: ConsoleAdmin, form: ConsoleForm) -> Response:
    return await _update_account(request, admin, account_id, {"plan": form.get("plan", "")[:64]}, "plan")


@router.post("/accounts/{account_id}/status")
async def change_status(request: Request, account_id: RowId, admin: ConsoleAdmin, form: ConsoleForm) -> Response:
    status = form.get("status", "")
    if status not in ("active", "suspended"):
        raise APIError(400, "The status is 'active' or 'suspended'.", param="status", code="invalid_value")
    return await _update_account(request, admin, account_id, {"status": status}, status)


# -- plans -------------------------------------------------------------------------------------

@router.get("/plans")
async def plans(request: Request, admin: ConsoleAdmin) -> Response:
    async with services_of(request).sessions() as session:
        rows = sorted(await session.scalars(select(Plan)), key=_plan_order)
        on_plan = dict((await session.execute(select(Account.plan, func.count()).group_by(Account.plan))).all())
    return _page(request, "admin/plans.html", {"rows": rows, "on_plan": on_plan})


def _plan_order(plan: Plan) -> tuple[Any, ...]:
    """As a price list reads: the cheapest first, unlimited (contract) plans last, retired ones after all."""
    return (plan.retired, plan.daily_limit is None, plan.monthly_price_cents, plan.daily_limit or 0, plan.name)


async def _plan(request: Request, name: str) -> Plan:
    async with services_of(request).sessions() as session:
        plan = await session.get(Plan, name[:64])
    if plan is None:
        raise not_found("plan", name[:64])
    return plan


def _plan_form(request: Request, plan: Plan, values: dict[str, str], errors: dict[str, str], *,
               status_code: int = 200) -> Response:
    template = "admin/_plan_form.html" if _htmx(request) else "admin/plan.html"
    return _page(request, template, {"plan": plan, "values": values, "errors": errors, "fields": PLAN_FIELDS},
                 status_code=status_code)


@router.get("/plans/{name}")
async def plan_form(request: Request, name: str, admin: ConsoleAdmin) -> Response:
    plan = await _plan(request, name)
    return _plan_form(request, plan, plan_values(plan), {})


@router.get("/plans/{name}/card")
async def plan_card(request: Request, name: str, admin: ConsoleAdmin) -> Response:
    """One plan's card (htmx puts it back when an edit is cancelled or saved)."""
    plan = await _plan(request, name)
    async with services_of(request).sessions() as session:
        on_it = await session.scalar(select(func.count()).select_from(Account).where(Account.plan == plan.name))
    return _page(request, "admin/_plan_card.html", {"plan": plan, "on_it": on_it})


@router.post("/plans/{name}")
async def save_plan(request: Request, name: str, admin: ConsoleAdmin, form: ConsoleForm) -> Response:
    services.require_write(admin)  # a read-only admin hears so before the form is read
    plan = await _plan(request, name)
    result = read_plan_form(plan, form)
    if result.errors:
        return _plan_form(request, plan, result.values, result.errors, status_code=200 if _htmx(request) else 422)
    changed = result.update.model_dump(exclude_unset=True) if result.update else {}
    if changed:
        try:
            plan = await services.update_plan(services_of(request).sessions, admin, plan.name, result.update)
        except APIError as exc:
            if not _on_the_form(exc):
                raise
            errors = {(exc.param or "display_name"): exc.message}
            return _plan_form(request, plan, result.values, errors, status_code=200 if _htmx(request) else exc.status)
    if _htmx(request):
        return await plan_card(request, plan.name, admin)
    return RedirectResponse(f"/console/admin/plans?done={'saved' if changed else 'unchanged'}", status_code=303)


# -- models ------------------------------------------------------------------------------------

@router.get("/models")
async def models(request: Request, admin: ConsoleAdmin) -> Response:
    rows, redis_up = await data.model_rows(services_of(request))
    context = {"rows": rows, "redis_up": redis_up}
    if _htmx(request) and request.headers.get("hx-target") == "model-rows":
        return _page(request, "admin/_model_rows.html", context)
    return _page(request, "admin/models.html", context)


@router.post("/models/{name:path}")
async def save_model(request: Request, name: str, admin: ConsoleAdmin, form: ConsoleForm) -> Response:
    """Enable or disable a catalog entry, pin it, set its minimum of workers or its idle timeout (blank:
    the fleet's default); a form sends any of them."""
    services.require_write(admin)  # a read-only admin hears so before the form is read
    fields: dict[str, Any] = {}
    for flag in ("enabled", "pinned"):
        if flag in form:
            fields[flag] = form[flag] in ("true", "on", "1")
    for number in ("min_workers", "idle_timeout_s"):
        if number in form:
            fields[number] = form[number][:16].strip() or None
    error = ""
    try:
        await catalog_services.update_model(services_of(request).sessions, admin, name[:128], ModelUpdate(**fields))
    except ValidationError as exc:
        error = f"{exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}"
    except APIError as exc:
        if not _on_the_form(exc):
            raise
        error = exc.message
    if not _htmx(request):
        if error:
            raise APIError(422, error, code="invalid_value")
        return RedirectResponse("/console/admin/models?done=saved", status_code=303)
    rows, redis_up = await data.model_rows(services_of(request))
    return _page(request, "admin/_model_rows.html", {"rows": rows, "redis_up": redis_up, "row_error": error,
                                                     "error_model": name})


# -- usage and audit ---------------------------------------------------------------------------

@router.get("/usage")
async def usage(request: Request, admin: ConsoleAdmin, days: Days = 30) -> Response:
    rows = await data.platform_usage(services_of(request), days)
    totals = {"requests": sum(r.requests for r in rows), "billable": sum(r.billable_requests for r in rows),
              "revenue": sum(r.price_micros for r in rows)}
    return _page(request, "admin/usage.html", {"rows": list(reversed(rows)), "chart": _chart(rows), "days": days,
                                               "ranges": USAGE_RANGES, "totals": totals})


@router.get("/audit")
async def audit(request: Request, admin: ConsoleAdmin, before: IdFilter = None, action: Action = "") -> Response:
    async with services_of(request).sessions() as session:
        rows, next_before = await data.audit_page(session, before=before, action=action)
        actions = list(await session.scalars(select(AuditEntry.action).distinct().order_by(AuditEntry.action)
                                             .limit(100)))
    entries = [{"entry": e, "changes": changes(e.before, e.after), "label": label(e)} for e in rows]
    return _page(request, "admin/audit.html", {"entries": entries, "next_before": next_before, "action": action,
                                               "actions": actions, "first": before is None})


def label(entry: AuditEntry) -> str:
    """The resource's name where its snapshot has one (an account's, a key's, a model's), else ''."""
    snapshot = entry.after or entry.before or {}
    name = snapshot.get("name")
    return str(name) if name and str(name) != entry.resource_id else ""


def changes(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """The fields an audit entry changed: (field, before, after); a create or delete lists every field."""
    before, after = before or {}, after or {}
    names = [k for k in {**before, **after} if before.get(k) != after.get(k)]
    return [(k, before.get(k), after.get(k)) for k in names]
