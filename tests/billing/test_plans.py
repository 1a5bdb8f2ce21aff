"""Plan rules with an injected clock: day windows, trials, overrides, OpenAI's duration format."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from flatfare.billing.plans import (PlanRules, account_terms, batch_line_price, effective_plan_name, openai_duration,
                                    quota_window)
from flatfare.storage.models import Account, Lane


def _plan(name: str, limit: int | None = 60, tz: str = "UTC") -> PlanRules:
    return PlanRules(name=name, daily_limit=limit, price_per_request_micros=0, lane=Lane.STANDARD,
                     allowed_models=None, max_output_tokens=None, max_n=1, max_body_bytes=1000, timezone=tz)


def test_utc_day_boundary() -> None:
    before = quota_window("UTC", datetime(2026, 12, 2, 23, 59, 59, 900_000, tzinfo=UTC))
    after = quota_window("UTC", datetime(2026, 12, 3, 0, 0, 0, 100_000, tzinfo=UTC))
    assert (before.day, after.day) == ("2026-12-02", "2026-12-03")
    assert before.resets_at == datetime(2026, 12, 3, tzinfo=UTC)
    assert before.seconds_left(datetime(2026, 12, 2, 23, 59, 59, 900_000, tzinfo=UTC)) == 1


def test_named_timezone_day_boundary() -> None:
    # Midnight in New York is 05:00 UTC in winter.
    assert quota_window("America/New_York", datetime(2026, 12, 3, 4, 59, 59, tzinfo=UTC)).day == "2026-12-02"
    window = quota_window("America/New_York", datetime(2026, 12, 3, 5, 0, 1, tzinfo=UTC))
    assert window.day == "2026-12-03" and window.resets_at == datetime(2026, 12, 4, 5, tzinfo=UTC)


def test_dst_day_is_23_hours() -> None:
    window = quota_window("Europe/Paris", datetime(2026, 3, 29, 0, 30, tzinfo=UTC))
    assert window.day == "2026-03-29"
    assert window.resets_at - datetime(2026, 3, 28, 23, tzinfo=UTC) == timedelta(hours=23)


@pytest.mark.parametrize(("seconds", "text"), [(59, "59s"), (360, "6m0s"), (3723, "1h2m3s"), (0, "0s")])
def test_openai_duration(seconds: int, text: str) -> None:
    assert openai_duration(seconds) == text


def test_trial_falls_back_to_free_when_it_ends() -> None:
    now = datetime(2026, 12, 2, tzinfo=UTC)
    account = Account(name="a", plan="trial", trial_ends_at=now + timedelta(days=7))
    assert effective_plan_name(account, now) == "trial"
    assert effective_plan_name(account, now + timedelta(days=7)) == "free"


def test_account_overrides() -> None:
    plans = {"enterprise": _plan("enterprise", None), "pro": _plan("pro", 1000)}
    now = datetime(2026, 12, 2, tzinfo=UTC)
    assert account_terms(Account(plan="pro", unlimited=False), plans, now).daily_limit == 1000
    assert account_terms(Account(plan="pro", daily_limit_override=60, unlimited=False), plans, now).daily_limit == 60
    terms = account_terms(Account(plan="enterprise", unlimited=True, dedicated_pool="acme"), plans, now)
    assert terms.daily_limit is None and terms.pool == "acme"


def test_in_flight_cap_comes_from_the_account_override_then_the_plan() -> None:
    plans = {"pro": replace(_plan("pro", 1000), max_inflight=16), "enterprise": _plan("enterprise", None)}
    now = datetime(2026, 12, 2, tzinfo=UTC)
    assert account_terms(Account(plan="pro", unlimited=False), plans, now).max_inflight == 16
    # The override replaces the plan's cap, above or below it.
    assert account_terms(Account(plan="pro", max_inflight_override=2, unlimited=False), plans, now).max_inflight == 2
    assert account_terms(Account(plan="pro", max_inflight_override=500, unlimited=False), plans,
                         now).max_inflight == 500
    # An unlimited account has no daily limit, but still its share of the engines.
    unlimited = account_terms(Account(plan="pro", unlimited=True), plans, now)
    assert (unlimited.daily_limit, unlimited.max_inflight) == (None, 16)
    # A plan without a cap (enterprise, as seeded) leaves an account without an override uncapped.
    assert account_terms(Account(plan="enterprise", unlimited=True), plans, now).max_inflight is None
    assert account_terms(Account(plan="enterprise", max_inflight_override=128, unlimited=True), plans,
                         now).max_inflight == 128


def test_a_batch_line_costs_the_plan_s_price_less_the_batch_discount() -> None:
    def price(micros: int, discount: int) -> int:
        return batch_line_price(replace(_plan("pro"), price_per_request_micros=micros,
                                        batch_discount_percent=discount))

    assert price(2000, 50) == 1000
    assert price(2000, 25) == 1500
    assert price(999, 50) == 499  # rounded down: never above the discounted price
    assert price(2000, 0) == 2000 and price(2000, 100) == 0 and price(2000, 150) == 0
