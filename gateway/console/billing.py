"""The customer's plan and billing page (upgrade through Stripe Checkout, manage in the customer portal)
and the pages Checkout returns to, ``/billing/success`` and ``/billing/cancel``. The success page says
only what Stripe's webhooks have recorded for the signed-in account: the plan it went to Checkout for is
confirmed, or still awaited; with billing off, that billing is off.

Checkout and the portal go through the same code as ``POST /v1/billing/checkout`` and ``/portal``
(:func:`flatfare.gateway.billing_routes.start_checkout`); the plan shown is the account row as the
webhooks left it, read on every request, so it changes as soon as Stripe's event lands."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select

from flatfare.gateway.billing_routes import buyable_plans, portal_url, start_checkout
from flatfare.gateway.console import keyspace
from flatfare.gateway.console.deps import BillingMember, ConsoleForm, Customer, LoginRequired, console_customer
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError
from flatfare.storage.models import Account, Plan
from flatfare.gateway.app_state import services_of

router = APIRouter(include_in_schema=False)
# The plans the page shows as cards, in this order (those that exist and are not retired); the account's
# own plan is shown first when it is none of these (the trial, a custom plan), so it is always marked.
SHOWN = ("free", "pro", "premium", "enterprise")
RETURNS = {"cancel": ("Checkout cancelled", "Nothing was charged and your plan is unchanged. You can upgrade "
                      "whenever you like.")}
# How long the plan a customer went to Checkout for is remembered (the success page compares it with
# what Stripe's webhooks have recorded): longer than anyone takes to pay.
CHECKOUT_MEMORY_S = 86_400
# Subscription states in which Stripe has confirmed the payment (billing/webhooks.py's _ACTIVE).
CONFIRMED = frozenset({"active", "trialing"})


async def _view(request: Request, account: Account) -> dict[str, Any]:
    settings = services_of(request).settings
    async with services_of(request).sessions() as db:
        plans = {plan.name: plan for plan in await db.scalars(select(Plan).where(Plan.retired.is_(False)))}
    current = plans.get(account.plan) or await _plan(request, account.plan)
    shown = [plans[name] for name in SHOWN if name in plans]
    if current is not None and current.name not in SHOWN:  # the trial, or a plan an operator made: marked too
        shown.insert(0, current)
    return {"current": current, "account": account, "plans": shown,
            "buyable": set(buyable_plans(settings)) if services_of(request).stripe is not None else set(),
            "billing_on": services_of(request).stripe is not None, "sales_contact": settings.sales_contact}


async def _plan(request: Request, name: str) -> Plan | None:
    async with services_of(request).sessions() as db:
        return await db.get(Plan, name)


async def _page(request: Request, customer: Customer, *, status_code: int = 200, **context: Any) -> Response:
    view = await _view(request, customer.account)
    if "hx-request" in request.headers and status_code >= 400:
        # htmx swaps only 2xx answers: the refusal comes as the whole page, in place of this one.
        response = render(request, "billing.html", {"customer": customer, **view, **context})
        response.headers.update({"HX-Retarget": "body", "HX-Reswap": "outerHTML"})
        return response
    return render(request, "billing.html", {"customer": customer, **view, **context}, status_code=status_code)


def _off_to(request: Request, url: str) -> Response:
    """Send the browser to Stripe. The console's CSP allows forms to post only to itself (form-action
    'self'), which a browser also applies to the redirect a form's answer makes: the page posts through
    htmx, and the answer tells htmx where to go (``HX-Redirect``); a plain form (no script) gets a 303."""
    if "hx-request" in request.headers:
        return Response(status_code=204, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


@router.get("/console/billing")
async def billing_page(request: Request, customer: BillingMember) -> Response:
    return await _page(request, customer)


@router.post("/console/billing/checkout")
async def checkout(request: Request, customer: BillingMember, form: ConsoleForm) -> Response:
    """Off to Stripe Checkout for the chosen plan; a refusal is shown on the page."""
    plan = form.get("plan", "")[:64]
    if plan == customer.account.plan:
        return await _page(request, customer, status_code=400, error=f"You are already on the {plan} plan.")
    try:
        _, url = await start_checkout(services_of(request), customer.account, plan)
    except APIError as exc:
        return await _page(request, customer, status_code=exc.status, error=exc.message)
    await services_of(request).redis.set(keyspace.console_checkout_key(customer.account.id), plan,
                                         ex=CHECKOUT_MEMORY_S)
    return _off_to(request, url)


@router.post("/console/billing/portal")
async def portal(request: Request, customer: BillingMember, form: ConsoleForm) -> Response:
    """Off to Stripe's customer portal (cancel, change card, invoices), back to this page afterwards."""
    back = services_of(request).settings.public_url.rstrip("/") + "/console/billing"
    try:
        url = await portal_url(services_of(request), customer.account, back)
    except APIError as exc:
        return await _page(request, customer, status_code=exc.status, error=exc.message)
    return _off_to(request, url)


@router.get("/console/billing/status")
async def status(request: Request, customer: BillingMember) -> Response:
    """The plan as the webhooks left it (an htmx fragment the return page polls); with ``?after=checkout``,
    also what the success page says about the customer's checkout."""
    view = await _view(request, customer.account)
    if request.query_params.get("after") == "checkout":
        return render(request, "_checkout_outcome.html", {**view, **await _checkout_outcome(request, customer)})
    return render(request, "_billing_status.html", view)


async def _checkout_outcome(request: Request, customer: Customer) -> dict[str, Any]:
    """What Stripe's webhooks have recorded about the customer's last checkout: ``state`` "confirmed" (the
    account is on the plan bought, its subscription active), "waiting" (not yet), or "none" (no checkout
    of theirs is remembered: the page was opened on its own)."""
    raw = await services_of(request).redis.get(keyspace.console_checkout_key(customer.account.id))
    wanted = raw.decode() if isinstance(raw, bytes) else raw
    account = customer.account
    if wanted is None:
        return {"state": "none", "wanted": None}
    confirmed = account.plan == wanted and account.subscription_status in CONFIRMED
    return {"state": "confirmed" if confirmed else "waiting", "wanted": await _plan(request, wanted)}


async def _maybe_customer(request: Request) -> Customer | None:
    try:
        return await console_customer(request)
    except LoginRequired:
        return None


async def _returned(request: Request, outcome: str) -> Response:
    customer = await _maybe_customer(request)
    context: dict[str, Any] = {"outcome": outcome, "customer": customer,
                               "billing_on": services_of(request).stripe is not None}
    if outcome == "cancel":
        context["title"], context["message"] = RETURNS[outcome]
    else:  # the success page claims nothing it has not seen recorded
        context["title"] = "Checkout" if context["billing_on"] else "Billing is off"
    if customer is not None:
        context.update(await _view(request, customer.account))
        if outcome == "success" and context["billing_on"]:
            context.update(await _checkout_outcome(request, customer))
    response = render(request, "billing_return.html", context)
    response.headers["Cache-Control"] = "no-store"
    return response


@router.get("/billing/success")
async def success(request: Request) -> Response:
    """Where Stripe Checkout sends the buyer after paying."""
    return await _returned(request, "success")


@router.get("/billing/cancel")
async def cancel(request: Request) -> Response:
    """Where Stripe Checkout sends the buyer who went back without paying."""
    return await _returned(request, "cancel")
