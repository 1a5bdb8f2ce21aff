"""Admin wire models. Create/Update models forbid unknown fields, so nothing that is not the
caller's to set (ids, hashes, audit fields, Stripe state) can be applied: it is refused with 422."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from flatfare.storage.models import Lane, as_utc

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")]
ModelName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")]
T = TypeVar("T")
# The largest value of an SQL INTEGER column (32 bits in PostgreSQL) and of a BIGINT one: a larger
# number fails in the database driver, so it is refused here (422) instead of there (500).
_INT = Annotated[int, Field(ge=0, le=2**31 - 1)]
_BIGINT = Annotated[int, Field(ge=0, le=2**63 - 1)]


# Requests in flight (queued or running) at once, for a plan, an account or a key; null: no cap of its own.
MaxInflight = Annotated[int, Field(ge=1, le=100_000)]


# Every timestamp leaves with its offset, as the schema's date-time format (RFC 3339) requires, and
# one a client sends without a zone is taken as UTC.
Timestamp = Annotated[datetime, AfterValidator(as_utc)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _refuse_null(cls: type, value: Any) -> Any:  # noqa: ARG001 - pydantic passes the class
    """For fields whose column cannot hold NULL: leaving one out keeps its value, but an explicit null
    would fail in the database (a 500), so it is refused here (422)."""
    if value is None:
        raise ValueError("leave the field out to keep its value; it cannot be null")
    return value


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    next_cursor: str | None = None


# -- plans -------------------------------------------------------------------------------------

class _PlanFields(_In):
    display_name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    daily_limit: _INT | None = None
    price_per_request_micros: _BIGINT | None = None
    monthly_price_cents: _INT | None = None
    lane: Lane | None = None
    allowed_models: list[ModelName] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    max_n: Annotated[int, Field(ge=1, le=128)] | None = None
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] | None = None
    # Input tokens per request; null: only the model's context bounds it.
    max_prompt_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    # Requests an account on the plan may have in flight; null: no cap.
    max_inflight: MaxInflight | None = None
    # Inputs one embeddings request may carry (one request is one unit: its work is bounded).
    max_embedding_inputs: Annotated[int, Field(ge=1, le=100_000)] | None = None
    # Percent off the per-request price for a Batch API line.
    batch_discount_percent: Annotated[int, Field(ge=0, le=100)] | None = None
    # Batch lines an account may have run or pending per quota day; null: no cap.
    batch_daily_limit: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    # Distinct client addresses a key may be used from in a UTC day before its owner is told; null: not watched.
    shared_key_alert_addresses: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    # Addresses a key may be used from at once (the last FLATFARE_SHARED_KEYS_WINDOW_S); null: no cap.
    shared_key_max_addresses: Annotated[int, Field(ge=1, le=10_000)] | None = None
    timezone: str | None = None
    trial_days: Annotated[int, Field(ge=1, le=365)] | None = None
    retired: bool | None = None

    _not_null = field_validator("display_name", "price_per_request_micros", "monthly_price_cents", "lane", "max_n",
                                "max_body_bytes", "max_embedding_inputs", "batch_discount_percent", "timezone",
                                "retired")(_refuse_null)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"unknown timezone {value!r}; use an IANA name such as 'UTC' or 'Europe/Paris'")
        return value


class PlanCreate(_PlanFields):
    name: Name
    display_name: Annotated[str, Field(min_length=1, max_length=128)]


class PlanUpdate(_PlanFields):
    pass


class PlanPublic(_Out):
    name: str
    display_name: str
    daily_limit: int | None
    price_per_request_micros: int
    monthly_price_cents: int
    lane: str
    allowed_models: list[str] | None
    max_output_tokens: int | None
    max_n: int
    max_body_bytes: int
    max_prompt_tokens: int | None
    max_inflight: int | None
    max_embedding_inputs: int
    batch_discount_percent: int
    batch_daily_limit: int | None
    shared_key_alert_addresses: int | None
    shared_key_max_addresses: int | None
    timezone: str
    trial_days: int | None
    retired: bool


# -- models: catalog_schemas.py (the wire models) and model_options.py (the engine options) ----


# -- accounts and keys -------------------------------------------------------------------------

class AccountCreate(_In):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    plan: Name = "free"
    daily_limit_override: _INT | None = None
    unlimited: bool = False
    dedicated_pool: Annotated[str, Field(max_length=128)] | None = None
    # Replaces the plan's max_inflight for this account; null: the plan's.
    max_inflight_override: MaxInflight | None = None


class AccountUpdate(_In):
    name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    plan: Name | None = None
    status: Literal["active", "suspended", "past_due"] | None = None
    daily_limit_override: _INT | None = None
    unlimited: bool | None = None
    dedicated_pool: Annotated[str, Field(max_length=128)] | None = None
    max_inflight_override: MaxInflight | None = None

    _not_null = field_validator("name", "plan", "status", "unlimited")(_refuse_null)


class AccountPublic(_Out):
    id: int
    name: str
    plan: str
    status: str
    created_at: Timestamp
    trial_ends_at: Timestamp | None
    daily_limit_override: int | None
    unlimited: bool
    dedicated_pool: str | None
    max_inflight_override: int | None
    stripe_customer_id: str | None
    subscription_status: str | None


# A key's own model list: at most this many names (a key lists what one client uses, not a catalog).
MAX_KEY_MODELS = 64
KeyModels = Annotated[list[ModelName], Field(min_length=1, max_length=MAX_KEY_MODELS)]
# A key's own daily cap; below the account's (a larger one simply never binds).
KeyDailyLimit = Annotated[int, Field(ge=1, le=2**31 - 1)]


class _KeyLimits(_In):
    """Per-key limits within the account's plan: null leaves each to the plan (models), the account
    (daily limit, requests in flight), or never (expiry)."""

    expires_at: Timestamp | None = None
    allowed_models: KeyModels | None = None
    daily_limit: KeyDailyLimit | None = None
    # Above the account's cap it never binds: the account's is checked too, and the lower one refuses.
    max_inflight: MaxInflight | None = None

    @field_validator("allowed_models")
    @classmethod
    def _distinct(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(dict.fromkeys(value))


class KeyCreate(_KeyLimits):
    name: Annotated[str, Field(max_length=128)] = ""


class KeyUpdate(_KeyLimits):
    """Leaving a field out keeps it; null clears it."""

    name: Annotated[str, Field(max_length=128)] | None = None

    _not_null = field_validator("name")(_refuse_null)


class KeyRotate(_In):
    grace_seconds: Annotated[int, Field(ge=0, le=30 * 86400)] = 86400
    name: Annotated[str, Field(max_length=128)] | None = None


class KeyPublic(_Out):
    id: int
    account_id: int
    name: str
    prefix: str
    created_at: Timestamp
    last_used_at: Timestamp | None
    revoked_at: Timestamp | None
    expires_at: Timestamp | None
    allowed_models: list[str] | None
    daily_limit: int | None
    max_inflight: int | None
    created_by_user_id: int | None = Field(default=None, description="The console member who made it; "
                                           "null: an operator (the admin API, the CLI).")


class KeyCreated(KeyPublic):
    key: str = Field(description="The secret. Shown once, never again.")


# -- admin tokens, audit -----------------------------------------------------------------------

class TokenCreate(_In):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    scopes: Annotated[list[Literal["admin:read", "admin:write"]], Field(min_length=1)]


class TokenPublic(_Out):
    id: int
    name: str
    prefix: str
    scopes: list[str]
    created_at: Timestamp
    created_by: int | None
    revoked_at: Timestamp | None


class TokenCreated(TokenPublic):
    token: str = Field(description="The secret. Shown once, never again.")


class MemberPublic(_Out):
    """A console user's membership of an account (the console's Team page manages them)."""

    user_id: int
    email: str
    role: str
    since: Timestamp


class AuditPublic(_Out):
    id: int
    at: Timestamp
    actor_id: int | None
    actor: str
    action: str
    resource_type: str
    resource_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    account_id: int | None = Field(default=None, description="The account a console member acted in.")
