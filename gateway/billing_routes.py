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

log = logging.getLogger("flatfare.billing")
router = APIRouter(tags=["billing"], responses=ERROR_RESPONSES)


class CheckoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    plan: str


def _stripe(request: Request) -> StripeGateway:
    stripe: StripeGateway | None = request.app.state.stripe
    if stripe is None:
        raise APIError(503, "Billing is not configured on this platform.", code="billing_not_configured")
    return stripe


def _unavailable(exc: BillingError) -> APIError:
    log.warning("stripe call failed: %s", exc)
    return APIError(502 if exc.retryable else 400, f"The payment provider refused the request: {exc}",
                    code="billing_error")


async def _customer(request: Request, caller: CurrentCaller, stripe: StripeGateway) -> str:
    if caller.account.stripe_customer_id:
        return caller.account.stripe_customer_id
    try:
        customer_id = await stripe.create_customer(caller.account_id, caller.account_name)
    except BillingError as exc:
        raise _unavailable(exc) from exc
    return await request.app.state.accounts.link_customer(caller.account_id, customer_id)


@router.post("/v1/billing/checkout")
async def checkout(request: Request, caller: CurrentCaller, body: CheckoutRequest) -> dict[str, Any]:
    """A Stripe Checkout session subscribing the caller's account to ``pro`` or ``premium``."""
    settings: GatewaySettings = request.app.state.settings
    stripe = _stripe(request)
    price = settings.stripe_prices.get(body.plan)
    if price is None:
        raise APIError(400, f"Plan '{body.plan}' cannot be bought; choose one of: "
                       f"{', '.join(sorted(settings.stripe_prices)) or 'none configured'}.", param="plan",
                       code="invalid_value")
    customer_id = await _customer(request, caller, stripe)
    try:
        session_id, url = await stripe.create_checkout_session(
            customer_id=customer_id, price_id=price, account_id=caller.account_id,
            success_url=f"{settings.public_url}/billing/success", cancel_url=f"{settings.public_url}/billing/cancel")
    except BillingError as exc:
        raise _unavailable(exc) from exc
    return {"object": "checkout.session", "id": session_id, "url": url, "plan": body.plan}


@router.post("/v1/billing/portal")
async def portal(request: Request, caller: CurrentCaller) -> dict[str, Any]:
    """A Stripe customer-portal link where the account manages or cancels its subscription."""
    settings: GatewaySettings = request.app.state.settings
    stripe = _stripe(request)
    customer_id = await _customer(request, caller, stripe)
    try:
        url = await stripe.create_portal_session(customer_id=customer_id, return_url=settings.public_url)
    except BillingError as exc:
        raise _unavailable(exc) from exc
    return {"object": "billing_portal.session", "url": url}


@router.post("/billing/stripe/webhook", include_in_schema=False)
async def stripe_webhook(request: Request, payload: RawBody,
                         stripe_signature: Annotated[str | None, Header()] = None) -> dict[str, str]:
    stripe = _stripe(request)
    try:
        event = stripe.verify_webhook(payload, stripe_signature)
    except InvalidWebhook as exc:
        log.warning("refused a Stripe webhook: %s", exc)
        raise APIError(400, "Invalid Stripe webhook signature or payload.", code="invalid_webhook") from exc
    outcome = await request.app.state.webhooks.apply(event)
    return {"received": event["id"], "outcome": outcome}
