"""Billing over HTTP: Checkout and the customer portal for developers, Stripe's webhook."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from pydantic import BaseModel, ConfigDict

from flatfare.billing.stripe_client import BillingError, InvalidWebhook, StripeGateway
from flatfare.gateway.deps import CurrentCaller, RawBody
from flatfare.gateway.errors import ERROR_RESPONSES, APIError
from flatfare.gateway.settings import GatewaySettings
from flatfare.storage.models import Account
from flatfare.gateway.app_state import Services, services_of

log = logging.getLogger("flatfare.billing")
router = APIRouter(tags=["billing"], responses=ERROR_RESPONSES)


class CheckoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    plan: str


def _stripe(state: Services) -> StripeGateway:
    stripe: StripeGateway | None = state.stripe
    if stripe is None:
        raise APIError(503, "Billing is not configured on this platform.", code="billing_not_configured")
    return stripe


def _unavailable(exc: BillingError) -> APIError:
    log.warning("stripe call failed: %s", exc)
    return APIError(502 if exc.retryable else 400, f"The payment provider refused the request: {exc}",
                    code="billing_error")


async def _customer(state: Services, account: Account, stripe: StripeGateway) -> str:
    if account.stripe_customer_id:
        return account.stripe_customer_id
    try:
        customer_id = await stripe.create_customer(account.id, account.name)
    except BillingError as exc:
        raise _unavailable(exc) from exc
    return await state.accounts.link_customer(account.id, customer_id)


def buyable_plans(settings: GatewaySettings) -> list[str]:
    """The plans a customer can buy through Checkout: those with a Stripe price."""
    return sorted(settings.stripe_prices)


async def start_checkout(state: Services, account: Account, plan: str) -> tuple[str, str]:
    """A Stripe Checkout session subscribing ``account`` to ``plan``: its monthly price, and its metered
    price when the plan charges per request. Returns the session's id and URL. The API route and the
    console's billing page both come here."""
    settings: GatewaySettings = state.settings
    stripe = _stripe(state)
    price = settings.stripe_prices.get(plan)
    if price is None:
        raise APIError(400, f"Plan '{plan}' cannot be bought; choose one of: "
                       f"{', '.join(buyable_plans(settings)) or 'none configured'}.", param="plan",
                       code="invalid_value")
    rules = (await state.plans.plans()).get(plan)
    metered = settings.stripe_metered_prices.get(plan)
    if rules is not None and rules.price_per_request_micros > 0 and not metered:
        # Its requests would be metered but never invoiced: refuse rather than sell it for less.
        log.error("plan %s has a per-request price but FLATFARE_STRIPE_METERED_PRICES names no price for it", plan)
        raise APIError(503, f"Plan '{plan}' cannot be bought right now: its per-request price has no Stripe "
                       "price configured. The platform's operator must set FLATFARE_STRIPE_METERED_PRICES.",
                       code="billing_not_configured")
    per_request = rules is not None and rules.price_per_request_micros > 0
    batch_metered = settings.stripe_batch_metered_prices.get(plan)
    if per_request and not batch_metered:
        # Sold all the same (a live request is invoiced), but its batch lines go uninvoiced: say so.
        log.warning("plan %s has a batch price but FLATFARE_STRIPE_BATCH_METERED_PRICES names no price for it: "
                    "its Batch API lines are metered and not invoiced", plan)
    customer_id = await _customer(state, account, stripe)
    try:
        return await stripe.create_checkout_session(
            customer_id=customer_id, price_id=price, account_id=account.id,
            metered_price_id=metered if per_request else None,
            batch_metered_price_id=batch_metered if per_request else None,
            success_url=f"{settings.public_url}/billing/success", cancel_url=f"{settings.public_url}/billing/cancel")
    except BillingError as exc:
        raise _unavailable(exc) from exc


async def portal_url(state: Services, account: Account, return_url: str | None = None) -> str:
    """A Stripe customer-portal link where ``account`` manages or cancels its subscription."""
    stripe = _stripe(state)
    customer_id = await _customer(state, account, stripe)
    try:
        return await stripe.create_portal_session(customer_id=customer_id,
                                                  return_url=return_url or state.settings.public_url)
    except BillingError as exc:
        raise _unavailable(exc) from exc


@router.post("/v1/billing/checkout")
async def checkout(request: Request, caller: CurrentCaller, body: CheckoutRequest) -> dict[str, Any]:
    """A Stripe Checkout session subscribing the caller's account to ``pro`` or ``premium``."""
    session_id, url = await start_checkout(services_of(request), caller.account, body.plan)
    return {"object": "checkout.session", "id": session_id, "url": url, "plan": body.plan}


@router.post("/v1/billing/portal")
async def portal(request: Request, caller: CurrentCaller) -> dict[str, Any]:
    """A Stripe customer-portal link where the account manages or cancels its subscription."""
    return {"object": "billing_portal.session", "url": await portal_url(services_of(request), caller.account)}


@router.post("/billing/stripe/webhook", include_in_schema=False)
async def stripe_webhook(request: Request, payload: RawBody,
                         stripe_signature: Annotated[str | None, Header()] = None) -> dict[str, str]:
    stripe = _stripe(services_of(request))
    try:
        event = stripe.verify_webhook(payload, stripe_signature)
    except InvalidWebhook as exc:
        log.warning("refused a Stripe webhook: %s", exc)
        raise APIError(400, "Invalid Stripe webhook signature or payload.", code="invalid_webhook") from exc
    outcome = await services_of(request).webhooks.apply(event)
    return {"received": event["id"], "outcome": outcome}
