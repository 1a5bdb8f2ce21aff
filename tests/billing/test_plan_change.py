"""How an account changes plan (flatfare.billing.plan_change), on each database: a trial ends its days after
it starts and starts once, a paid subscription's plan never ends, a retired plan takes no new accounts,
and a change no admin made is audited in its own transaction."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from flatfare.billing.plan_change import PlanChangeRefused, change_plan, ensure_account, start_trial
from flatfare.storage.audit import Actor
from flatfare.storage.models import Account, AuditEntry, Plan

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
CUSTOMER = Actor(None, "console:dev@example.com")


async def _actions(session) -> list[tuple[str | None, str, str]]:
    return [tuple(row) for row in await session.execute(select(AuditEntry.actor, AuditEntry.action,
                                                                AuditEntry.resource_id).order_by(AuditEntry.id))]


async def test_a_trial_ends_its_days_after_the_account_is_put_on_it(sessions) -> None:
    async with sessions() as session, session.begin():
        account = await ensure_account(session, "acme", "free")
        await change_plan(session, account, "trial", now=NOW)
        assert (account.plan, account.trial_ends_at, account.trial_started_at) == ("trial", NOW + timedelta(days=7),
                                                                                  NOW)
        await change_plan(session, account, "pro", now=NOW)
        assert (account.plan, account.trial_ends_at, account.trial_started_at) == ("pro", None, NOW)
        assert await _actions(session) == []  # an admin's change is audited by the admin's write around it


async def test_a_paid_subscription_s_plan_never_ends_and_may_be_retired(sessions) -> None:
    async with sessions() as session, session.begin():
        await session.execute(update(Plan).where(Plan.name == "trial").values(retired=True))
        account = await ensure_account(session, "acme", "free")
        with pytest.raises(PlanChangeRefused) as refused:
            await change_plan(session, account, "trial")
        assert refused.value.code == "plan_retired"
        with pytest.raises(PlanChangeRefused, match="Unknown plan 'gold'"):
            await change_plan(session, account, "gold")
        await change_plan(session, account, "trial", paid=True, actor=Actor(None, "stripe"))
        assert (account.plan, account.trial_ends_at) == ("trial", None)
        assert await _actions(session) == [("stripe", "account.plan", str(account.id))]


async def test_the_trial_starts_once_from_free_and_is_audited_as_the_customer_s(sessions) -> None:
    async with sessions() as session, session.begin():
        account = await ensure_account(session, "acme", "free")
        assert await start_trial(session, account, CUSTOMER)
        assert account.plan == "trial"
        await change_plan(session, account, "free")  # back on Free: the trial was had
        assert not await start_trial(session, account, CUSTOMER)
        paying = await ensure_account(session, "bigco", "pro")
        assert not await start_trial(session, paying, CUSTOMER)  # a paying account would lose its plan
        assert await _actions(session) == [(CUSTOMER.name, "account.plan", str(account.id))]
        assert (await session.get(Account, paying.id)).plan == "pro"
