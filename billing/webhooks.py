"""Stripe webhook events applied to accounts: each once, in order, whatever order they arrive in. A
subscription that starts, changes or ends moves the account's plan through billing's one rule set
(:func:`flatfare.billing.plan_change.change_plan`), which leaves an audit entry naming Stripe.

Every event id is recorded in ``stripe_events`` in the same transaction that applies it, so a
replayed event is a no-op. An account remembers the ``created`` time of the newest event applied to
it; an older event that arrives late is recorded and ignored.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing.plan_change import STRIPE, PlanChangeRefused, change_plan
from flatfare.billing.plans import FALLBACK_PLAN
from flatfare.storage.models import Account, AccountStatus, StripeEvent

log = logging.getLogger("flatfare.billing")

_ACTIVE = {"active", "trialing"}
_PAST_DUE = {"past_due", "unpaid"}
_ENDED = {"canceled", "incomplete_expired"}


def _subscription_price(subscription: dict[str, Any]) -> str | None:
    items = (subscription.get("items") or {}).get("data") or []
    if not items:
        return None
    item = items[0]
    price = item.get("price") or item.get("plan") or {}
    return price.get("id") if isinstance(price, dict) else price


class WebhookProcessor:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], plan_for_price: dict[str, str]) -> None:
        self._sessions = sessions
        self._plan_for_price = plan_for_price

    async def apply(self, event: dict[str, Any]) -> str:
        """Apply ``event`` once; returns what happened (for the log and the tests)."""
        async with self._sessions() as session:
            try:
                async with session.begin():
                    session.add(StripeEvent(id=event["id"], type=event["type"], created=int(event["created"]),
                                            received_at=datetime.now(UTC), outcome="pending"))
                    await session.flush()
                    outcome = await self._apply(session, event)
                    record = await session.get(StripeEvent, event["id"])
                    record.outcome = outcome
            except IntegrityError:
                return "duplicate"
        log.info("stripe event %s %s: %s", event["id"], event["type"], outcome)
        return outcome

    async def _apply(self, session: AsyncSession, event: dict[str, Any]) -> str:
        obj = event["data"]["object"]
        kind = event["type"]
        if kind == "checkout.session.completed":
            return await self._checkout_completed(session, obj, int(event["created"]))
        if kind.startswith("customer.subscription."):
            return await self._subscription(session, kind, obj, int(event["created"]))
        if kind in ("invoice.payment_failed", "invoice.payment_succeeded"):
            return await self._invoice(session, kind, obj, int(event["created"]))
        return "ignored"

    async def _account(self, session: AsyncSession, customer_id: str | None) -> Account | None:
        if not customer_id:
            return None
        return await session.scalar(select(Account).where(Account.stripe_customer_id == customer_id)
                                    .with_for_update())

    @staticmethod
    def _stale(account: Account, created: int) -> bool:
        if account.billing_event_at is not None and created < account.billing_event_at:
            return True
        account.billing_event_at = created
        return False

    async def _checkout_completed(self, session: AsyncSession, obj: dict[str, Any], created: int) -> str:
        account = await self._account(session, obj.get("customer"))
        if account is None:
            return "unknown customer"
        if obj.get("subscription") and not account.stripe_subscription_id:
            account.stripe_subscription_id = obj["subscription"]
        return "linked"

    async def _subscription(self, session: AsyncSession, kind: str, sub: dict[str, Any], created: int) -> str:
        account = await self._account(session, sub.get("customer"))
        if account is None:
            return "unknown customer"
        if self._stale(account, created):
            return "stale"
        status = sub.get("status")
        if kind == "customer.subscription.deleted" or status in _ENDED:
            if account.stripe_subscription_id in (None, sub.get("id")):
                await change_plan(session, account, FALLBACK_PLAN, actor=STRIPE)
                account.stripe_subscription_id = None
                account.subscription_status = "canceled"
                if account.status == AccountStatus.PAST_DUE:
                    account.status = AccountStatus.ACTIVE.value
            return f"plan {account.plan}"
        plan = self._plan_for_price.get(_subscription_price(sub) or "")
        if plan is None:
            return "unknown price"
        account.stripe_subscription_id = sub.get("id")
        account.subscription_status = status
        if status in _ACTIVE:
            try:
                await change_plan(session, account, plan, paid=True, actor=STRIPE)
            except PlanChangeRefused as exc:  # FLATFARE_STRIPE_PRICES names a plan the catalog lacks
                log.error("stripe event for %s: %s", account.name, exc)
                return "unknown plan"
            if account.status == AccountStatus.PAST_DUE:
                account.status = AccountStatus.ACTIVE.value
        elif status in _PAST_DUE:
            account.status = AccountStatus.PAST_DUE.value
        return f"plan {account.plan}, {account.status}"

    async def _invoice(self, session: AsyncSession, kind: str, invoice: dict[str, Any], created: int) -> str:
        account = await self._account(session, invoice.get("customer"))
        if account is None:
            return "unknown customer"
        if self._stale(account, created):
            return "stale"
        if kind == "invoice.payment_failed" and account.stripe_subscription_id:
            account.status = AccountStatus.PAST_DUE.value
        elif kind == "invoice.payment_succeeded" and account.status == AccountStatus.PAST_DUE:
            account.status = AccountStatus.ACTIVE.value
        return account.status
