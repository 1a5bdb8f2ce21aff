"""Plan rules as plain functions: which plan applies, its daily window, its limits and price.

Nothing here touches Redis, SQL or HTTP, so every rule is testable with an injected clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from flatfare.storage.models import Account, Lane, Plan

FALLBACK_PLAN = "free"


@dataclass(frozen=True, slots=True)
class PlanRules:
    name: str
    daily_limit: int | None
    price_per_request_micros: int
    lane: Lane
    allowed_models: frozenset[str] | None
    max_output_tokens: int | None
    max_n: int
    max_body_bytes: int
    timezone: str
    # Input tokens one request may send (all its prompts together); None: the model's context bounds it.
    max_prompt_tokens: int | None = None
    # Requests an account may have queued or running at once; None: no cap.
    max_inflight: int | None = None
    # Inputs one embeddings request may carry (each is one sequence the engine pools).
    max_embedding_inputs: int = 32
    # Batch API lines: the discount off the per-request price (percent), and lines a day (None: no cap).
    batch_discount_percent: int = 0
    batch_daily_limit: int | None = None
    # Shared-key detection: distinct addresses a key may be used from a UTC day before its owner is told,
    # and at once before a request from another address is refused (None: neither).
    shared_key_alert_addresses: int | None = None
    shared_key_max_addresses: int | None = None

    @classmethod
    def from_row(cls, plan: Plan) -> PlanRules:
        return cls(
            name=plan.name, daily_limit=plan.daily_limit, price_per_request_micros=plan.price_per_request_micros,
            lane=Lane(plan.lane), allowed_models=frozenset(plan.allowed_models) if plan.allowed_models is not None
            else None, max_output_tokens=plan.max_output_tokens, max_n=plan.max_n,
            max_body_bytes=plan.max_body_bytes, timezone=plan.timezone, max_prompt_tokens=plan.max_prompt_tokens,
            max_inflight=plan.max_inflight, max_embedding_inputs=plan.max_embedding_inputs,
            batch_discount_percent=plan.batch_discount_percent, batch_daily_limit=plan.batch_daily_limit,
            shared_key_alert_addresses=plan.shared_key_alert_addresses,
            shared_key_max_addresses=plan.shared_key_max_addresses,
        )

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


def batch_line_price(plan: PlanRules) -> int:
    """A Batch API line's price: the plan's per-request price less its batch discount (rounded down)."""
    return plan.price_per_request_micros * (100 - min(max(plan.batch_discount_percent, 0), 100)) // 100


@dataclass(frozen=True, slots=True)
class AccountTerms:
    """What an account may do right now: its plan's rules with the account's own overrides."""

    plan: PlanRules
    daily_limit: int | None
    pool: str | None = None
    # Requests in flight (queued or running) at once; None: no cap.
    max_inflight: int | None = None


def effective_plan_name(account: Account, now: datetime) -> str:
    """A trial that has ended falls back to the free plan."""
    if account.trial_ends_at is not None:
        if account.plan == "trial" and now >= account.trial_ends_at:
            return FALLBACK_PLAN
    return account.plan


def account_terms(account: Account, plans: dict[str, PlanRules], now: datetime) -> AccountTerms:
    plan = plans[effective_plan_name(account, now)]
    if account.unlimited:
        limit = None
    elif account.daily_limit_override is not None:
        limit = account.daily_limit_override
    else:
        limit = plan.daily_limit
    # ``unlimited`` lifts the daily limit only: the in-flight cap is the account's share of the
    # engines, not an allowance. An override replaces the plan's cap, above or below it.
    inflight = account.max_inflight_override if account.max_inflight_override is not None else plan.max_inflight
    return AccountTerms(plan=plan, daily_limit=limit, pool=account.dedicated_pool, max_inflight=inflight)


@dataclass(frozen=True, slots=True)
class QuotaWindow:
    """One quota day: its label (the local date) and when it ends, in UTC."""

    day: str
    resets_at: datetime

    def seconds_left(self, now: datetime) -> int:
        return max(int((self.resets_at - now).total_seconds() + 0.999), 1)


# timezone -> (the day's start in UTC, its window): every request of a day asks for the same one.
_WINDOWS: dict[str, tuple[datetime, QuotaWindow]] = {}


def quota_window(timezone: str, now: datetime) -> QuotaWindow:
    """The calendar day containing ``now`` in ``timezone`` (midnight to midnight, local time)."""
    known = _WINDOWS.get(timezone)
    if known is not None and known[0] <= now < known[1].resets_at:
        return known[1]
    zone = ZoneInfo(timezone)
    local = now.astimezone(zone)
    midnight = datetime(local.year, local.month, local.day, tzinfo=zone)
    # Adding a day to the local date, then localising, keeps DST days 23 or 25 hours long.
    next_local = (midnight + timedelta(days=1)).replace(tzinfo=None)
    resets_at = next_local.replace(tzinfo=zone).astimezone(UTC)
    window = QuotaWindow(day=local.date().isoformat(), resets_at=resets_at)
    _WINDOWS[timezone] = (midnight.astimezone(UTC), window)
    return window


def openai_duration(seconds: int) -> str:
    """OpenAI's reset format: ``6m0s``, ``1h2m3s``, ``59s``."""
    hours, rest = divmod(max(seconds, 0), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
