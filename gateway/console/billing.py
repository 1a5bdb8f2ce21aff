"""The customer's plan and billing page (upgrade through Stripe Checkout, manage in the customer portal)
and the pages Checkout returns to, ``/billing/success`` and ``/billing/cancel``.

Checkout and the portal go through the same code as ``POST /v1/billing/checkout`` and ``/portal``
(:func:`flatfare.gateway.billing_routes.start_checkout`); the plan shown is the account row as the
webhooks left it, read on every request, so it changes as soon as Stripe's event lands."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select

from flatfare.gateway.billing_routes import buyable_plans, portal_url, start_checkout
from flatfare.gateway.console.deps import ConsoleCustomer, ConsoleForm, Customer, LoginRequired, console_customer
from flatfare.gateway.console.pages import render
from flatfare.gateway.errors import APIError
from flatfare.storage.models import Account, Plan

router = APIRouter(include_in_schema=False)
# The plans the page shows as cards, in this order (those that exist and are not retired).
SHOWN = ("free", "pro", "premium", "enterprise")
RETURNS = {"success": ("Payment received", "Thank you! Checkout is complete. Your plan changes as soon as Stripe "
                       "confirms the subscription, usually within a few seconds."),
           "cancel": ("Checkout cancelled", "Nothing was charged and your plan is unchanged. You can upgrade "
                      "whenever you like.")}


async def _view(request: Request, account: Account) -> dict[str, Any]:
    settings = request.app.state.settings
    async with request.app.state.sessions() as db:
        plans = {plan.name: plan for plan in await db.scalars(select(Plan).where(Plan.retired.is_(False)))}
    return {"current": plans.get(account.plan) or await _plan(request, account.plan), "account": account,
            "plans": [plans[name] for name in SHOWN if name in plans],
            "buyable": set(buyable_plans(settings)) if request.app.state.stripe is not None else set(),
            "billing_on": request.app.state.stripe is not None}


async def _plan(request: Request, name: str) -> Plan | None:
    async with request.app.state.sessions() as db:
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
async def billing_page(request: Request, customer: ConsoleCustomer) -> Response:
    return await _page(request, customer)


@router.post("/console/billing/checkout")
async def checkout(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """Off to Stripe Checkout for the chosen plan; a refusal is shown on the page."""
    plan = form.get("plan", "")[:64]
    if plan == customer.account.plan:
        return await _page(request, customer, status_code=400, error=f"You are already on the {plan} plan.")
    try:
        _, url = await start_checkout(request.app.state, customer.account, plan)
    except APIError as exc:
        return await _page(request, customer, status_code=exc.status, error=exc.message)
    return _off_to(request, url)


@router.post("/console/billing/portal")
async def portal(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    """Off to Stripe's customer portal (cancel, change card, invoices), back to this page afterwards."""
    back = request.app.state.settings.public_url.rstrip("/") + "/console/billing"
    try:
        url = await portal_url(request.app.state, customer.account, back)
    except APIError as exc:
        return await _page(request, customer, status_code=exc.status, error=exc.message)
    return _off_to(request, url)


@router.get("/console/billing/status")
async def status(request: Request, customer: ConsoleCustomer) -> Response:
    """The plan as the webhooks left it (an htmx fragment the return page polls)."""
    view = await _view(request, customer.account)
    return render(request, "_billing_status.html", view)


async def _maybe_customer(request: Request) -> Customer | None:
    try:
        return await console_customer(request)
    except LoginRequired:
        return None


async def _returned(request: Request, outcome: str) -> Response:
    customer = await _maybe_customer(request)
    title, message = RETURNS[outcome]
    context: dict[str, Any] = {"outcome": outcome, "title": title, "message": message, "customer": customer}
    if customer is not None:
        context.update(await _view(request, customer.account))
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
