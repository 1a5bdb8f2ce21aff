"""The customer's overview and account pages: plan at a glance, the one-time trial, password change."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import func, select

from flatfare.gateway.console.shared_key_notice import shared_keys_of
from flatfare.gateway.console import lockout, users
from flatfare.gateway.console.auth import TOO_MANY, client_address, limiter
from flatfare.gateway.console.ratelimit import address_subject, email_subject
from flatfare.gateway.console.deps import BillingMember, ConsoleCustomer, ConsoleForm, sessions_of
from flatfare.gateway.console.pages import render
from flatfare.gateway.roles import Area
from flatfare.billing import plan_change
from flatfare.storage.audit import Actor
from flatfare.storage.models import Account, ApiKey, Plan
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)

# Messages a redirect may ask for by name (never free text from the URL: a crafted link could say anything).
FLASHES = {"trial": ("Your trial has started.", "ok"),
           "no-trial": ("The trial is not available for this account.", "error"),
           "password": ("Your password was changed. Other sessions were logged out.", "ok"),
           "welcome": ("Welcome to Flatfare! Create an API key to make your first request.", "ok"),
           "joined": ("You joined the account. What you may do here depends on your role: see Team.", "ok"),
           "left": ("You left the account. You now act for another account of yours.", "ok")}


def flash(request: Request) -> dict[str, str]:
    message, kind = FLASHES.get(request.query_params.get("done", ""), ("", "ok"))
    return {"flash": message, "flash_kind": kind} if message else {}


@router.get("")
async def overview(request: Request, customer: ConsoleCustomer) -> Response:
    now = datetime.now(UTC)
    terms = await services_of(request).plans.terms(customer.account, now)
    async with services_of(request).sessions() as db:
        plan = await db.get(Plan, terms.plan.name)
        trial = await db.get(Plan, plan_change.TRIAL_PLAN)
        key_count = await db.scalar(select(func.count()).select_from(ApiKey).where(
            ApiKey.account_id == customer.account.id, ApiKey.revoked_at.is_(None)))
    offer = trial if customer.may(Area.BILLING) and plan_change.trial_available(customer.account, trial) else None
    return render(request, "overview.html", {"customer": customer, "plan": plan, "daily_limit": terms.daily_limit,
                                             "key_count": key_count, "trial_offer": offer,
                                             "shared_key_warnings": await shared_keys_of(services_of(request),
                                                                                         customer.account.id),
                                             **flash(request)})


@router.post("/trial")
async def start_trial(request: Request, customer: BillingMember, form: ConsoleForm) -> Response:
    """Put the account on the trial plan, once (billing's rule: flatfare.billing.plan_change)."""
    async with services_of(request).sessions() as db, db.begin():
        account = await db.get(Account, customer.account.id, with_for_update=True)
        started = await plan_change.start_trial(db, account, Actor(None, f"console:{customer.user.email}"))
    return RedirectResponse(f"/console?done={'trial' if started else 'no-trial'}", status_code=303)


@router.get("/account")
async def account_page(request: Request, customer: ConsoleCustomer) -> Response:
    return render(request, "account.html", {"customer": customer, **flash(request)})


@router.post("/account/password")
async def change_password(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """A new password, after the current one is checked; every other session of the user ends."""
    settings = services_of(request).settings
    # Limited as the login page is, on the same counters: a session in someone else's hands must not
    # become a way to guess the password.
    address = client_address(request)
    subjects = (address_subject(address), email_subject(customer.user.email, address))
    attempts = limiter(request)
    if await attempts.blocked(*subjects):
        return render(request, "account.html", {"customer": customer, "error": TOO_MANY}, status_code=429)
    current = await users.authenticate(services_of(request).sessions, customer.user.email, form.get("current", ""))
    if current is None:
        _, email_locked = await attempts.failed(*subjects)
        response = render(request, "account.html", {"customer": customer,
                                                    "error": "The current password is not right."}, status_code=400)
        if email_locked:
            response.background = lockout.notice(services_of(request), customer.user.email, address,
                                                 lockout.Where.PASSWORD_FORM)
        return response
    await attempts.clear(subjects[1])
    try:
        users.check_new_password(form.get("password", ""), settings.console_min_password_length)
    except users.ConsoleUserError as exc:
        return render(request, "account.html", {"customer": customer, "error": str(exc)}, status_code=400)
    user = await users.set_password(services_of(request).sessions, customer.user.id, form["password"])
    # Every session ends, this one too: the one that carries on starts under a new id and the new
    # password's stamp (sessions from before the change are refused by the stamp anyway).
    await sessions_of(request).end_all(customer.user.id)
    response = RedirectResponse("/console/account?done=password", status_code=303)
    await sessions_of(request).start(response, user_id=user.id, account_id=user.account_id, email=user.email,
                                     admin=user.is_admin, password_hash=user.password_hash,
                                     replacing=customer.session)
    return response
