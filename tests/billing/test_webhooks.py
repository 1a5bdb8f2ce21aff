"""Stripe webhooks on real SQL: a signed event is applied once, events apply in order whatever order
they arrive in, and a body whose signature does not verify is refused. Events are signed here the
way Stripe signs them (HMAC-SHA256 of ``{timestamp}.{body}``); no network is involved."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.stripe_client import InvalidWebhook, StripeConfig, StripeGateway
from flatfare.billing.webhooks import WebhookProcessor
from flatfare.storage.models import Account, AuditEntry, StripeEvent
from tests.billing.conftest import account_with_key

SECRET = "whsec_flatfare_test"
PRICES = {"price_pro": "pro", "price_premium": "premium"}
CUSTOMER = "cus_hooks"


@pytest.fixture
def stripe() -> StripeGateway:
    return StripeGateway(StripeConfig(api_key="sk_test_hooks", webhook_secret=SECRET, api_base="http://127.0.0.1:9"))


@pytest.fixture
async def processor(sessions: async_sessionmaker[AsyncSession]) -> WebhookProcessor:
    await account_with_key(sessions, "acme", "free", stripe_customer_id=CUSTOMER)
    return WebhookProcessor(sessions, PRICES)


def _signed(event: dict[str, Any], secret: str = SECRET, at: int | None = None) -> tuple[bytes, str]:
    body = json.dumps(event).encode()
    at = int(time.time()) if at is None else at
    signature = hmac.new(secret.encode(), b"%d.%s" % (at, body), hashlib.sha256).hexdigest()
    return body, f"t={at},v1={signature}"


def _subscription(event_id: str, created: int, *, status: str = "active", price: str = "price_pro",
                  kind: str = "customer.subscription.updated", subscription: str = "sub_1") -> dict[str, Any]:
    return {"id": event_id, "type": kind, "created": created,
            "data": {"object": {"id": subscription, "customer": CUSTOMER, "status": status,
                                "items": {"data": [{"price": {"id": price}}]}}}}


def _invoice(event_id: str, created: int, kind: str) -> dict[str, Any]:
    return {"id": event_id, "type": kind, "created": created,
            "data": {"object": {"id": "in_1", "customer": CUSTOMER, "subscription": "sub_1"}}}


async def _account(sessions: async_sessionmaker[AsyncSession]) -> Account:
    async with sessions() as session:
        return await session.scalar(select(Account).where(Account.stripe_customer_id == CUSTOMER))


async def _set_plan(sessions: async_sessionmaker[AsyncSession], plan: str) -> None:
    async with sessions() as session, session.begin():
        (await session.scalar(select(Account).where(Account.stripe_customer_id == CUSTOMER))).plan = plan


async def test_a_signed_event_is_applied_once(sessions, processor, stripe) -> None:
    upgrade = _subscription("evt_1", int(time.time()))
    event = stripe.verify_webhook(*_signed(upgrade))
    assert event == upgrade
    assert await processor.apply(event) == "plan pro, active"
    account = await _account(sessions)
    assert (account.plan, account.stripe_subscription_id, account.subscription_status) == ("pro", "sub_1", "active")

    # An operator moves the account back meanwhile; Stripe delivers the same event again.
    await _set_plan(sessions, "free")
    assert await processor.apply(stripe.verify_webhook(*_signed(upgrade))) == "duplicate"
    assert (await _account(sessions)).plan == "free"
    async with sessions() as session:
        recorded = (await session.scalars(select(StripeEvent))).all()
    assert [(e.id, e.type, e.outcome) for e in recorded] == [("evt_1", "customer.subscription.updated",
                                                               "plan pro, active")]


async def test_two_deliveries_of_one_event_at_once_apply_it_once(sessions, processor) -> None:
    outcomes = await asyncio.gather(*(processor.apply(_invoice("evt_fail", int(time.time()), "invoice.payment_failed"))
                                      for _ in range(2)))
    assert sorted(outcomes) == ["active", "duplicate"]  # the account has no subscription yet: stays active


async def test_an_older_event_after_a_newer_one_changes_nothing(sessions, processor) -> None:
    now = int(time.time())
    assert await processor.apply(_subscription("evt_new", now, price="price_premium")) == "plan premium, active"
    # The older "pro" update arrives late: recorded (so it is not applied on redelivery) and ignored.
    assert await processor.apply(_subscription("evt_old", now - 60)) == "stale"
    assert await processor.apply(_invoice("evt_old_invoice", now - 30, "invoice.payment_failed")) == "stale"
    account = await _account(sessions)
    assert (account.plan, account.status, account.billing_event_at) == ("premium", "active", now)
    async with sessions() as session:
        assert await session.get(StripeEvent, "evt_old") is not None

    # The cancellation that follows applies (same second counts as in order), and an older upgrade
    # arriving after it does not bring the plan back.
    assert await processor.apply(_subscription("evt_cancel", now, status="canceled",
                                               kind="customer.subscription.deleted")) == "plan free"
    assert await processor.apply(_subscription("evt_older_upgrade", now - 1, price="price_premium")) == "stale"
    account = await _account(sessions)
    assert (account.plan, account.stripe_subscription_id, account.subscription_status) == ("free", None, "canceled")


async def test_a_failed_payment_makes_the_account_past_due_until_one_succeeds(sessions, processor) -> None:
    now = int(time.time())
    await processor.apply(_subscription("evt_sub", now))
    assert await processor.apply(_invoice("evt_failed", now + 1, "invoice.payment_failed")) == "past_due"
    assert (await _account(sessions)).status == "past_due"
    assert await processor.apply(_invoice("evt_paid", now + 2, "invoice.payment_succeeded")) == "active"
    assert ((await _account(sessions)).plan, (await _account(sessions)).status) == ("pro", "active")


async def test_an_event_that_fails_to_apply_is_not_recorded_so_its_redelivery_applies(sessions, processor) -> None:
    broken = {"id": "evt_broken", "type": "customer.subscription.updated", "created": int(time.time()), "data": {}}
    with pytest.raises(KeyError):
        await processor.apply(broken)
    async with sessions() as session:
        assert await session.get(StripeEvent, "evt_broken") is None
    assert await processor.apply(_subscription("evt_broken", int(time.time()))) == "plan pro, active"


async def test_events_for_unknown_customers_or_prices_change_nothing(sessions, processor) -> None:
    now = int(time.time())
    stranger = _subscription("evt_stranger", now)
    stranger["data"]["object"]["customer"] = "cus_nobody"
    assert await processor.apply(stranger) == "unknown customer"
    assert await processor.apply(_subscription("evt_price", now, price="price_unknown")) == "unknown price"
    assert await processor.apply({"id": "evt_other", "type": "charge.refunded", "created": now,
                                  "data": {"object": {}}}) == "ignored"
    assert (await _account(sessions)).plan == "free"


@pytest.mark.parametrize("forgery", ["wrong secret", "tampered body", "too old", "no signature", "not an event"])
def test_a_bad_signature_is_refused(stripe, forgery: str) -> None:
    event = _subscription("evt_forged", int(time.time()))
    body, signature = _signed(event)
    if forgery == "wrong secret":
        body, signature = _signed(event, secret="whsec_wrong")
    elif forgery == "tampered body":
        body = body.replace(b"price_pro", b"price_premium")
    elif forgery == "too old":  # past the 300 s tolerance: a captured delivery replayed later
        body, signature = _signed(event, at=int(time.time()) - 1000)
    elif forgery == "no signature":
        signature = None
    else:  # signed, but not a Stripe event
        body, signature = _signed({"hello": "world"})  # type: ignore[arg-type]
    with pytest.raises(InvalidWebhook):
        stripe.verify_webhook(body, signature)


async def test_a_subscription_s_plan_change_is_audited_as_stripe_s(sessions: async_sessionmaker[AsyncSession],
                                                                  processor: WebhookProcessor) -> None:
    """The webhook moves the plan through billing's one rule set, which records who moved it."""
    assert await processor.apply(_subscription("evt_audit_1", 100)) == "plan pro, active"
    assert await processor.apply(_subscription("evt_audit_2", 200, kind="customer.subscription.deleted",
                                               status="canceled")) == "plan free"
    async with sessions() as session:
        entries = (await session.execute(select(AuditEntry.actor, AuditEntry.action, AuditEntry.before,
                                                AuditEntry.after).order_by(AuditEntry.id))).all()
    assert [(actor, action, before["plan"], after["plan"]) for actor, action, before, after in entries] == [
        ("stripe", "account.plan", "free", "pro"), ("stripe", "account.plan", "pro", "free")]
