"""The customer's overview and account pages: plan at a glance, the one-time trial, password change."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func, select

from flatfare.gateway.console import users
from flatfare.gateway.console.deps import ConsoleCustomer, ConsoleForm, sessions_of
from flatfare.gateway.console.pages import render
from flatfare.storage.accounts import ensure_account
from flatfare.storage.models import Account, ApiKey, Plan

router = APIRouter(prefix="/console", include_in_schema=False)

TRIAL_PLAN = "trial"
# Only a Free account is offered the trial: a paying one would lose its plan to it.
TRIAL_FROM = "free"
# Messages a redirect may ask for by name (never free text from the URL: a crafted link could say anything).
FLASHES = {"trial": ("Your trial has started.", "ok"),
           "no-trial": ("The trial is not available for this account.", "error"),
           "password": ("Your password was changed. Other sessions were logged out.", "ok"),
           "welcome": ("Welcome to Flatfare! Create an API key to make your first request.", "ok")}


def flash(request: Request) -> dict[str, str]:
    message, kind = FLASHES.get(request.query_params.get("done", ""), ("", "ok"))
    return {"flash": message, "flash_kind": kind} if message else {}


@router.get("")
async def overview(request: Request, customer: ConsoleCustomer) -> Response:
    now = datetime.now(UTC)
    terms = await request.app.state.plans.terms(customer.account, now)
    async with request.app.state.sessions() as db:
        plan = await db.get(Plan, terms.plan.name)
        trial = await db.get(Plan, TRIAL_PLAN)
        key_count = await db.scalar(select(func.count()).select_from(ApiKey).where(
            ApiKey.account_id == customer.account.id, ApiKey.revoked_at.is_(None)))
    offer = trial if trial_available(customer.account, trial) else None
    return render(request, "overview.html", {"customer": customer, "plan": plan, "daily_limit": terms.daily_limit,
                                             "key_count": key_count, "trial_offer": offer,
                                             **flash(request)})


def trial_available(account: Account, trial: Plan | None) -> bool:
    return (trial is not None and not trial.retired and bool(trial.trial_days) and account.plan == TRIAL_FROM
            and account.trial_started_at is None)


@router.post("/trial")
async def start_trial(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """Put the account on the trial plan, once: the account services set its end from now."""
    async with request.app.state.sessions() as db, db.begin():
        account = await db.get(Account, customer.account.id, with_for_update=True)
        if not trial_available(account, await db.get(Plan, TRIAL_PLAN)):
            return RedirectResponse("/console?done=no-trial", status_code=303)
        account.trial_started_at = datetime.now(UTC)
        await ensure_account(db, account.name, TRIAL_PLAN)
    return RedirectResponse("/console?done=trial", status_code=303)


@router.get("/account")
async def account_page(request: Request, customer: ConsoleCustomer) -> Response:
    return render(request, "account.html", {"customer": customer, **flash(request)})


@router.post("/account/password")
async def change_password(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """A new password, after the current one is checked; every other session of the user ends."""
    settings = request.app.state.settings
    current = await users.authenticate(request.app.state.sessions, customer.user.email, form.get("current", ""))
    if current is None:
        return render(request, "account.html", {"customer": customer, "error": "The current password is not right."},
                      status_code=400)
    try:
        users.check_new_password(form.get("password", ""), settings.console_min_password_length)
    except users.ConsoleUserError as exc:
        return render(request, "account.html", {"customer": customer, "error": str(exc)}, status_code=400)
    user = await users.set_password(request.app.state.sessions, customer.user.id, form["password"])
    # Every session ends, this one too: the one that carries on starts under a new id and the new
    # password's stamp (sessions from before the change are refused by the stamp anyway).
    await sessions_of(request).end_all(customer.user.id)
    response = RedirectResponse("/console/account?done=password", status_code=303)
    await sessions_of(request).start(response, user_id=user.id, account_id=user.account_id, email=user.email,
                                     admin=user.is_admin, password_hash=user.password_hash,
                                     replacing=customer.session)
    return response
