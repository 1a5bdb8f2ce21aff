"""The admin console's plan form read into the admin API's PlanUpdate: only what changed, dollars to
micro-dollars and cents exactly, and every refusal the API would make, by form field. No services."""

from __future__ import annotations

from flatfare.storage.models import Plan
from flatfare.gateway.console.admin_forms import MAX_FIELD_CHARS, plan_values, read_plan_form


def _pro() -> Plan:
    return Plan(name="pro", display_name="Pro", daily_limit=1000, price_per_request_micros=2000,
                monthly_price_cents=8000, lane="standard", allowed_models=None, max_output_tokens=4096,
                max_prompt_tokens=32768, max_n=8, max_body_bytes=8 * 1024 * 1024, max_inflight=16, timezone="UTC",
                trial_days=None, retired=False, max_embedding_inputs=256, batch_discount_percent=50,
                batch_daily_limit=1000)


def test_an_unchanged_form_changes_nothing() -> None:
    plan = _pro()
    values = plan_values(plan)
    assert (values["price_per_request"], values["monthly_price"], values["daily_limit"]) == ("0.002", "80", "1000")
    result = read_plan_form(plan, values)
    assert result.errors == {} and result.update.model_dump(exclude_unset=True) == {}


def test_only_the_changed_fields_are_sent_in_the_apis_units() -> None:
    plan = _pro()
    form = {**plan_values(plan), "daily_limit": "1,500", "price_per_request": "0.0025", "monthly_price": "99.99",
            "allowed_models": " a , b,, ", "max_inflight": "", "retired": "on"}
    result = read_plan_form(plan, form)
    assert result.errors == {}
    assert result.update.model_dump(exclude_unset=True) == {
        "daily_limit": 1500, "price_per_request_micros": 2500, "monthly_price_cents": 9999,
        "allowed_models": ["a", "b"], "max_inflight": None, "retired": True}


def test_refusals_are_reported_by_form_field() -> None:
    plan = _pro()
    form = {**plan_values(plan), "daily_limit": "many", "price_per_request": "0.0000001", "monthly_price": "-1",
            "max_n": "", "timezone": "Nowhere/Else"}
    result = read_plan_form(plan, form)
    assert result.update is None
    assert result.errors == {"daily_limit": "Enter a whole number.", "price_per_request": "At most 6 decimals.",
                             "monthly_price": "Enter an amount of zero or more.", "max_n": "Required."}
    # Once the numbers parse, the API's own validators speak (PlanUpdate), under the form's names.
    form = {**plan_values(plan), "max_n": "500", "timezone": "Nowhere/Else", "price_per_request": "1e30",
            "lane": "gold"}
    errors = read_plan_form(plan, form).errors
    assert set(errors) == {"max_n", "timezone", "price_per_request", "lane"}
    assert errors["max_n"] == "Input should be less than or equal to 128."
    assert errors["timezone"].startswith("Unknown timezone 'Nowhere/Else'")
    for bad in ("NaN", "Infinity", "0x10"):
        assert "price_per_request" in read_plan_form(plan, {**plan_values(plan), "price_per_request": bad}).errors


def test_a_field_is_bounded_before_it_is_parsed() -> None:
    plan = _pro()
    result = read_plan_form(plan, {**plan_values(plan), "display_name": "x" * 100_000})
    assert len(result.values["display_name"]) == MAX_FIELD_CHARS
    assert "display_name" in result.errors  # longer than the API's 128 characters
