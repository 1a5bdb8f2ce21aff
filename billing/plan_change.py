"""How an account changes plan: one rule set for every way it happens. An account is created on a plan
(sign-up, the admin API, the CLI), an admin moves it (the admin API and the admin console, through
their audited write), a customer starts the one-time trial (the console), Stripe says a subscription
started, changed or ended (the webhooks). Each goes through :func:`change_plan`:

- the plan must exist; a retired plan takes no new accounts (a subscription Stripe already bills for
  still applies: the customer paid);
- a plan with ``trial_days`` (the trial) ends that long after the account is put on it, and the
  account has had its trial from then on; any other plan has no end (a paid subscription's plan
  never falls back, whatever its trial days);
- a change no admin made is audited here, in its transaction (an admin's is audited by the admin
  services' write around it).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.billing.plans import FALLBACK_PLAN
from flatfare.storage.accounts import AccountError
from flatfare.storage.audit import Actor, record, snapshot
from flatfare.storage.models import Account, AccountStatus, Plan

TRIAL_PLAN = "trial"
# Only a Free account is offered the trial: a paying one would lose its plan to it.
TRIAL_FROM = FALLBACK_PLAN
STRIPE = Actor(None, "stripe")


class PlanChangeRefused(AccountError):
    """The change was refused; ``code`` names why for an API answer, the message says it to a person."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def change_plan(session: AsyncSession, account: Account, plan_name: str, *, paid: bool = False,
                      actor: Actor | None = None, now: datetime | None = None) -> Account:
    """Put ``account`` (locked by the caller) on ``plan_name``. ``paid``: Stripe bills for it (a
    subscription). ``actor``: who asked, when no audited admin write wraps the change (its entry is
    added here, ``account.plan``)."""
    now = now or datetime.now(UTC)
    plan = await _open_plan(session, plan_name, paid)
    before = snapshot(account) if actor is not None else None
    account.plan = plan.name
    trial = bool(plan.trial_days) and not paid
    # A trial runs from the moment the account is put on it.
    account.trial_ends_at = now + timedelta(days=plan.trial_days) if trial else None
    if trial and account.trial_started_at is None:
        account.trial_started_at = now
    await session.flush()
    if actor is not None and (after := snapshot(account)) != before:
        record(session, actor, "account.plan", "account", account.id, before, after)
    return account


async def _open_plan(session: AsyncSession, name: str, paid: bool) -> Plan:
    """The plan an account may be put on (refused: unknown, or retired unless Stripe bills for it)."""
    plan = await session.get(Plan, name)
    if plan is None:
        known = ", ".join(sorted(await session.scalars(select(Plan.name))))
        raise PlanChangeRefused("invalid_value", f"Unknown plan {name!r}; the plans are: {known}.")
    if plan.retired and not paid:
        raise PlanChangeRefused("plan_retired", f"The plan '{name}' is retired.")
    return plan


async def ensure_account(session: AsyncSession, name: str, plan: str | None = None) -> Account:
    """The account called ``name``, created on ``plan`` (default Free) if it does not exist; an existing
    one is moved to ``plan`` when given and different. A plan it may not be put on adds nothing."""
    account = await session.scalar(select(Account).where(Account.name == name))
    if account is not None and (plan is None or account.plan == plan):
        return account
    if account is None:
        await _open_plan(session, plan or FALLBACK_PLAN, paid=False)
        account = Account(name=name, plan=plan or FALLBACK_PLAN, status=AccountStatus.ACTIVE.value)
        session.add(account)
    return await change_plan(session, account, plan or FALLBACK_PLAN)


def trial_available(account: Account, trial: Plan | None) -> bool:
    """The customer may start the trial: offered (not retired, with trial days), from Free, once."""
    return (trial is not None and not trial.retired and bool(trial.trial_days) and account.plan == TRIAL_FROM
            and account.trial_started_at is None)


async def start_trial(session: AsyncSession, account: Account, actor: Actor) -> bool:
    """Put ``account`` (locked by the caller) on the trial if it may start it; False if not."""
    if not trial_available(account, await session.get(Plan, TRIAL_PLAN)):
        return False
    await change_plan(session, account, TRIAL_PLAN, actor=actor)
    return True
