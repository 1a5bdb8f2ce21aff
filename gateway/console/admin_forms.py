"""The admin console's forms: what an admin types, read into the admin API's own update models, so a
value the API would refuse is refused here for the same reason, shown beside the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import ValidationError

from flatfare.storage.models import Plan
from flatfare.gateway.admin.schemas import PlanUpdate

# Every text field of a form is bounded before it is parsed: the body limit bounds the whole form,
# this bounds what one field may make us parse or echo back.
MAX_FIELD_CHARS = 2048
MICROS_PER_DOLLAR = Decimal(1_000_000)
CENTS_PER_DOLLAR = Decimal(100)

# The plan form's fields, in the order the form shows them: (form field, label, help).
PLAN_FIELDS: list[tuple[str, str, str]] = [
    ("display_name", "Display name", "What customers see."),
    ("daily_limit", "Requests a day", "Empty: no daily limit."),
    ("price_per_request", "Price per request (USD)", "Metered per billable request, e.g. 0.002."),
    ("monthly_price", "Monthly price (USD)", "The subscription's price."),
    ("lane", "Lane", "premium requests are served first."),
    ("max_inflight", "Requests in flight", "Queued or running at once; empty: no cap."),
    ("max_n", "Sequences a request", "prompts x n x best_of."),
    ("max_output_tokens", "Output tokens", "Empty: the model's context."),
    ("max_prompt_tokens", "Input tokens", "Empty: the model's context."),
    ("max_body_bytes", "Body bytes", "1,024 to 67,108,864."),
    ("allowed_models", "Models", "Comma-separated; empty: every model."),
    ("max_embedding_inputs", "Embedding inputs", "Inputs one embeddings request may carry."),
    ("batch_discount_percent", "Batch discount (%)", "Off the per-request price for a Batch API line; 0 to 100."),
    ("batch_daily_limit", "Batch lines a day", "Run or pending per quota day; empty: no cap."),
    ("shared_key_alert_addresses", "Shared-key alert (addresses a day)",
     "A key used from more client addresses in a UTC day is flagged and its owner told; empty: not watched."),
    ("shared_key_max_addresses", "Addresses a key at once",
     "More, within the last minutes, are refused (429 key_shared_too_widely); empty: no cap."),
    ("timezone", "Day's timezone", "IANA name, e.g. UTC or Europe/Paris."),
    ("trial_days", "Trial days", "Empty: not a trial."),
]
_NULLABLE_INTS = {"daily_limit", "max_inflight", "max_output_tokens", "max_prompt_tokens", "trial_days",
                  "batch_daily_limit", "shared_key_alert_addresses", "shared_key_max_addresses"}
_INTS = {"max_n", "max_body_bytes", "max_embedding_inputs", "batch_discount_percent"}
# A pydantic error on an API field belongs to this form field.
_FORM_FIELD_OF = {"price_per_request_micros": "price_per_request", "monthly_price_cents": "monthly_price"}


@dataclass
class FormResult:
    """The update to apply (only what changed), or the errors to show by form field."""

    update: PlanUpdate | None = None
    errors: dict[str, str] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)


def _dollars(text: str, unit: Decimal, what: str) -> int:
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"Enter {what} in dollars, such as 0.002.") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError("Enter an amount of zero or more.")
    scaled = amount * unit
    if scaled != scaled.to_integral_value():
        raise ValueError(f"At most {len(str(int(unit))) - 1} decimals.")
    return int(scaled)


def plan_values(plan: Plan) -> dict[str, str]:
    """A plan as the form shows it."""

    def text(value: Any) -> str:
        return "" if value is None else str(value)

    return {
        "display_name": plan.display_name,
        "daily_limit": text(plan.daily_limit),
        "price_per_request": format(Decimal(plan.price_per_request_micros) / MICROS_PER_DOLLAR, "f"),
        "monthly_price": format(Decimal(plan.monthly_price_cents) / CENTS_PER_DOLLAR, "f"),
        "lane": plan.lane,
        "max_inflight": text(plan.max_inflight),
        "max_n": text(plan.max_n),
        "max_output_tokens": text(plan.max_output_tokens),
        "max_prompt_tokens": text(plan.max_prompt_tokens),
        "max_body_bytes": text(plan.max_body_bytes),
        "allowed_models": ", ".join(plan.allowed_models) if plan.allowed_models is not None else "",
        "max_embedding_inputs": text(plan.max_embedding_inputs),
        "batch_discount_percent": text(plan.batch_discount_percent),
        "batch_daily_limit": text(plan.batch_daily_limit),
        "shared_key_alert_addresses": text(plan.shared_key_alert_addresses),
        "shared_key_max_addresses": text(plan.shared_key_max_addresses),
        "timezone": plan.timezone,
        "trial_days": text(plan.trial_days),
        "retired": "on" if plan.retired else "",
    }


def read_plan_form(plan: Plan, form: dict[str, str]) -> FormResult:
    """Parse the plan form against ``plan``: the fields whose values changed, validated as
    ``PATCH /admin/v1/plans/{name}`` validates them."""
    values = {name: str(form.get(name, ""))[:MAX_FIELD_CHARS].strip() for name, _, _ in PLAN_FIELDS}
    values["retired"] = "on" if form.get("retired") else ""
    result = FormResult(values=values)
    fields: dict[str, Any] = {"display_name": values["display_name"], "lane": values["lane"],
                              "timezone": values["timezone"], "retired": bool(values["retired"])}
    for name in _NULLABLE_INTS | _INTS:
        text = values[name].replace(",", "").replace("_", "")
        if not text:
            if name in _INTS:
                result.errors[name] = "Required."
            fields[name] = None
            continue
        try:
            fields[name] = int(text)
        except ValueError:
            result.errors[name] = "Enter a whole number."
    for name, api_name, unit in (("price_per_request", "price_per_request_micros", MICROS_PER_DOLLAR),
                                 ("monthly_price", "monthly_price_cents", CENTS_PER_DOLLAR)):
        try:
            fields[api_name] = _dollars(values[name] or "0", unit, "a price")
        except ValueError as exc:
            result.errors[name] = str(exc)
    models = [m.strip() for m in values["allowed_models"].split(",") if m.strip()]
    fields["allowed_models"] = models or None
    if result.errors:
        return result
    current_fields = {"display_name": plan.display_name, "lane": plan.lane, "timezone": plan.timezone,
                      "retired": plan.retired, "price_per_request_micros": plan.price_per_request_micros,
                      "monthly_price_cents": plan.monthly_price_cents, "allowed_models": plan.allowed_models,
                      **{name: getattr(plan, name) for name in _NULLABLE_INTS | _INTS}}
    changed = {name: value for name, value in fields.items() if current_fields.get(name) != value}
    try:
        result.update = PlanUpdate(**changed)
    except ValidationError as exc:
        for error in exc.errors():
            api_field = str(error["loc"][0]) if error["loc"] else "display_name"
            result.errors.setdefault(_FORM_FIELD_OF.get(api_field, api_field), _message(error))
    return result


def _message(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "Invalid value."))
    message = message.removeprefix("Value error, ")
    return message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")
