"""The only module that calls Stripe. Stripe's errors become :class:`BillingError` here.

Uses the official SDK's ``StripeClient`` with its async httpx transport; ``api_base`` points it at
localstripe (or any Stripe-compatible server) in tests and local runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import stripe


class BillingError(Exception):
    """A Stripe call failed. ``retryable`` says whether trying again later may succeed."""

    def __init__(self, message: str, *, retryable: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class InvalidWebhook(Exception):
    """A webhook whose signature, timestamp or body does not verify."""


@dataclass(frozen=True, slots=True)
class StripeConfig:
    api_key: str
    webhook_secret: str
    api_base: str | None = None
    meter_event_name: str = "flatfare_requests"
    # Batch API lines: a meter of their own, priced per plan at the batch discount.
    batch_meter_event_name: str = "flatfare_batch_requests"
    webhook_tolerance_s: int = 300
    # Per call; a call that times out is retried later (meter events safely: see send_meter_event).
    timeout_s: float = 20.0


def _translate(exc: stripe.StripeError) -> BillingError:
    status = getattr(exc, "http_status", None)
    retryable = isinstance(exc, (stripe.APIConnectionError, stripe.RateLimitError)) or (status or 0) >= 500
    return BillingError(f"Stripe: {exc.user_message or exc.__class__.__name__}", retryable=retryable, status=status)


class StripeGateway:
    def __init__(self, config: StripeConfig) -> None:
        self.config = config
        base = {"api": config.api_base} if config.api_base else None
        self._client = stripe.StripeClient(config.api_key, base_addresses=base, max_network_retries=0,
                                           http_client=stripe.HTTPXClient(timeout=config.timeout_s))

    async def _call(self, coroutine: Any) -> Any:
        try:
            return await coroutine
        except stripe.StripeError as exc:
            raise _translate(exc) from exc

    async def create_customer(self, account_id: int, account_name: str) -> str:
        customer = await self._call(self._client.v1.customers.create_async(
            params={"name": account_name, "metadata": {"flatfare_account_id": str(account_id)}}))
        return customer.id

    async def create_checkout_session(self, *, customer_id: str, price_id: str, account_id: int,
                                      success_url: str, cancel_url: str,
                                      metered_price_id: str | None = None,
                                      batch_metered_price_id: str | None = None) -> tuple[str, str]:
        """A subscription Checkout for the plan's monthly price, plus its metered per-request price and its
        batch lines' metered price when it has them: a metered price takes no quantity, Stripe invoices
        the meter's usage each period."""
        items: list[dict[str, Any]] = [{"price": price_id, "quantity": 1}]
        for metered in (metered_price_id, batch_metered_price_id):
            if metered:
                items.append({"price": metered})
        session = await self._call(self._client.v1.checkout.sessions.create_async(params={
            "mode": "subscription", "customer": customer_id, "client_reference_id": str(account_id),
            "line_items": items, "success_url": success_url, "cancel_url": cancel_url}))
        return session.id, session.url

    async def create_portal_session(self, *, customer_id: str, return_url: str) -> str:
        session = await self._call(self._client.v1.billing_portal.sessions.create_async(
            params={"customer": customer_id, "return_url": return_url}))
        return session.url

    async def send_meter_event(self, *, customer_id: str, identifier: str, timestamp: int, value: int = 1,
                               batch: bool = False) -> None:
        """One billable request (``batch``: a Batch API line, to the batch meter), sent as many times as it
        takes, billed once: Stripe keeps one event per ``identifier``, and the idempotency key makes a
        retry of a call whose answer was lost (a timeout after Stripe recorded it) get the first call's
        answer instead of a duplicate's error."""
        event_name = self.config.batch_meter_event_name if batch else self.config.meter_event_name
        await self._call(self._client.v1.billing.meter_events.create_async(params={
            "event_name": event_name, "identifier": identifier, "timestamp": timestamp,
            "payload": {"stripe_customer_id": customer_id, "value": str(value)}},
            options={"idempotency_key": f"meter-{identifier}"}))

    def verify_webhook(self, payload: bytes, signature: str | None) -> dict[str, Any]:
        """The event as a dict, after checking its signature and a 300 s timestamp tolerance."""
        try:
            stripe.Webhook.construct_event(payload, signature, self.config.webhook_secret,
                                           tolerance=self.config.webhook_tolerance_s)
            event = json.loads(payload)
        except (stripe.SignatureVerificationError, ValueError) as exc:
            raise InvalidWebhook(str(exc)) from exc
        if not isinstance(event, dict) or not {"id", "type", "created", "data"} <= event.keys():
            raise InvalidWebhook("not a Stripe event")
        return event
