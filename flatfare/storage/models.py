"""The SQL tables. Wire models (what clients send and see) live with the routes, not here."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, String, Text, UniqueConstraint,
                        func, true)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from flatfare.contract import Lane

__all__ = ["Lane"]  # plans name their lane with the contract's enum


def as_utc(moment: datetime) -> datetime:
    """The moment in UTC. A naive one is UTC already: Flatfare stores UTC, and SQLite keeps no zone."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp column, written in UTC and read back as an aware UTC datetime on every database
    (SQLite's DATETIME keeps no zone), so no reader has to normalise it."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[str]: JSON, list[int]: JSON}


class AccountStatus(StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    PAST_DUE = "past_due"


class MemberRole(StrEnum):
    """What a console user may do in an account (gateway/roles.py says which pages each opens)."""

    OWNER = "owner"
    ADMIN = "admin"
    DEVELOPER = "developer"  # keys and usage
    BILLING = "billing"  # plan and invoices only


class RequestStatus(StrEnum):
    QUEUED = "queued"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Plan(Base):
    __tablename__ = "plans"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    display_name: Mapped[str] = mapped_column(String(128))
    # None: unlimited (enterprise accounts may be).
    daily_limit: Mapped[int | None] = mapped_column(Integer)
    price_per_request_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    monthly_price_cents: Mapped[int] = mapped_column(Integer, default=0)
    lane: Mapped[str] = mapped_column(String(16), default=Lane.STANDARD.value)
    # None: every model in the catalog.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)
    max_output_tokens: Mapped[int | None] = mapped_column(Integer)
    # Input tokens one request may send; None: the model's context is the only bound.
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    # Sequences one request may generate: prompts x n (x best_of when larger).
    max_n: Mapped[int] = mapped_column(Integer, default=1)
    max_body_bytes: Mapped[int] = mapped_column(Integer, default=1_048_576)
    # Requests an account on the plan may have queued or running at once; None: no cap.
    max_inflight: Mapped[int | None] = mapped_column(Integer)
    # Inputs one embeddings request may carry: one request is one unit, so its work is bounded.
    max_embedding_inputs: Mapped[int] = mapped_column(Integer, default=32, server_default="32")
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    trial_days: Mapped[int | None] = mapped_column(Integer)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The Batch API: percent off the per-request price for a batch line, and the batch lines an account
    # may have run or pending per quota day, apart from daily_limit (None: no cap).
    batch_discount_percent: Mapped[int] = mapped_column(Integer, default=50, server_default="50")
    batch_daily_limit: Mapped[int | None] = mapped_column(Integer)
    # Shared-key detection (flatfare.gateway.shared_keys): a key used from more distinct client addresses
    # in a UTC day than this is listed as shared and its owner told (None: not watched), and a key may be
    # used from at most this many addresses at once (in the last FLATFARE_SHARED_KEYS_WINDOW_S; None: no cap).
    shared_key_alert_addresses: Mapped[int | None] = mapped_column(Integer)
    shared_key_max_addresses: Mapped[int | None] = mapped_column(Integer)


class Account(Base):
    __tablename__ = "accounts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    plan: Mapped[str] = mapped_column(ForeignKey("plans.name"))
    status: Mapped[str] = mapped_column(String(16), default=AccountStatus.ACTIVE.value)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    trial_ends_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    stripe_customer_id: Mapped[str | None] = mapped_column(String(64), unique=True)
    daily_limit_override: Mapped[int | None] = mapped_column(Integer)
    unlimited: Mapped[bool] = mapped_column(Boolean, default=False)
    dedicated_pool: Mapped[str | None] = mapped_column(String(128))
    # None: the plan's max_inflight; a number replaces it for this account.
    max_inflight_override: Mapped[int | None] = mapped_column(Integer)
    stripe_subscription_id: Mapped[str | None] = mapped_column(String(64))
    subscription_status: Mapped[str | None] = mapped_column(String(32))
    billing_event_at: Mapped[int | None] = mapped_column(BigInteger)
    # When the account's customer started its one self-service trial in the console (None: never).
    trial_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ApiKey(Base):
    """An API key. Only its SHA-256 and a short visible prefix are stored, never the secret."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Set on the old key when it is rotated: it keeps working until then.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # None: the account's plan decides; a list narrows the models this key may use.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON)
    # None: the account's daily limit; a number caps this key's requests a day below it.
    daily_limit: Mapped[int | None] = mapped_column(Integer)
    # None: only the account's cap; a number caps this key's requests in flight (the lower one binds).
    max_inflight: Mapped[int | None] = mapped_column(Integer)
    # The console user who made it (None: an operator, the admin API or the CLI). Removing that member
    # from the account revokes it, unless the remover moves it to another member.
    created_by_user_id: Mapped[int | None] = mapped_column(ForeignKey("console_users.id"), index=True)


class CatalogModel(Base):
    """A model Flatfare may serve, and the engine options its workers start it with."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    # A local folder, a hub id, or "builtin:<name>" for a model Flatfare prepares itself.
    source: Mapped[str] = mapped_column(String(512))
    engine_options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # Pinned: always warm. Otherwise on demand: a fleet supervisor starts (or wakes) it when a request
    # is queued for it and puts it to sleep (stops it, on a CPU host) after ``idle_timeout_s`` unused.
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    min_workers: Mapped[int] = mapped_column(Integer, default=0)
    # None: the fleet's default (FLATFARE_FLEET_IDLE_TIMEOUT_S).
    idle_timeout_s: Mapped[int | None] = mapped_column(Integer)
    # Set for a LoRA variant: ``source`` is the adapter, served by the engines of this catalog model.
    base_model: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    # Plans that may use the model; None means every plan whose own list allows it.
    plans: Mapped[list[str] | None] = mapped_column(JSON)


class RequestRecord(Base):
    """The ledger: one row per request the gateway accepted, keyed by its request id."""

    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(32))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.QUEUED.value)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    queue_ms: Mapped[int | None] = mapped_column(Integer)
    ttft_ms: Mapped[int | None] = mapped_column(Integer)
    duration_ms: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    http_status: Mapped[int | None] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64))
    # False once the request's quota unit was given back (it failed before its first token).
    billable: Mapped[bool] = mapped_column(Boolean, default=True)
    price_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    plan: Mapped[str | None] = mapped_column(String(64))
    quota_day: Mapped[str | None] = mapped_column(String(10))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    body_sha256: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        UniqueConstraint("account_id", "idempotency_key", name="uq_requests_account_idempotency"),
        Index("ix_requests_quota", "account_id", "quota_day"),
    )


class UsageDaily(Base):
    """The ledger rolled up per account, key, model and day (the row's quota day), written in the same
    transaction as the ledger rows it sums, so it always equals a GROUP BY over ``requests``: every
    accepted request, the billable ones and their price. Usage pages read it instead of the ledger."""

    __tablename__ = "usage_daily"

    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    billable_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    price_micros: Mapped[int] = mapped_column(BigInteger, default=0)


class PlatformUsageDaily(Base):
    """The same sums for the whole platform per day and model (the admin console's usage over time and
    requests today per model), written beside :class:`UsageDaily`."""

    __tablename__ = "usage_platform_daily"

    day: Mapped[str] = mapped_column(String(10), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    billable_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    price_micros: Mapped[int] = mapped_column(BigInteger, default=0)


class OutboxStatus(StrEnum):
    PENDING = "pending"
    SENT = "sent"
    SKIPPED = "skipped"


class Meter(StrEnum):
    """Which Stripe meter a usage row goes to: live requests at the plan's per-request price, Batch API
    lines at its batch price (a meter of their own, priced per plan at the discount)."""

    REQUESTS = "requests"
    BATCH = "batch_requests"


class UsageOutbox(Base):
    """One Stripe meter event to send per billable request, written with the ledger's final update."""

    __tablename__ = "usage_outbox"

    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id"), primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    day: Mapped[str] = mapped_column(String(10), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16), default=OutboxStatus.PENDING.value, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime())
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_error: Mapped[str | None] = mapped_column(String(512))
    meter: Mapped[str] = mapped_column(String(32), default=Meter.REQUESTS.value, server_default=Meter.REQUESTS.value)


class StripeEvent(Base):
    """A Stripe webhook event already applied (or deliberately ignored): each is applied once."""

    __tablename__ = "stripe_events"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    type: Mapped[str] = mapped_column(String(128))
    created: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime())
    outcome: Mapped[str] = mapped_column(String(64))


class AdminToken(Base):
    """A credential for the admin API, separate from API keys; stored as a SHA-256 only."""

    __tablename__ = "admin_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    created_by: Mapped[int | None] = mapped_column(ForeignKey("admin_tokens.id"))
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ConsoleUser(Base):
    """A person who logs in to the web console: an email and an Argon2 hash of their password, for one
    account (or the platform, when ``is_admin``)."""

    __tablename__ = "console_users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # Stored lower-cased, so the unique index is case-insensitive on every database.
    email: Mapped[str] = mapped_column(String(254), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    account_id: Mapped[int | None] = mapped_column(ForeignKey("accounts.id"), index=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    email_verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())


class AccountMember(Base):
    """A console user's membership of an account, with their role. A user's ``account_id`` is the account
    the console acts for now; this table says which accounts they may act for, and how."""

    __tablename__ = "account_members"

    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("console_users.id"), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), server_default=func.now())


class AccountInvite(Base):
    """An emailed invitation to join an account: only the SHA-256 of its link's token is kept; it works
    once (``accepted_at``) and until ``expires_at``."""

    __tablename__ = "account_invites"
    __table_args__ = (Index("ix_account_invites_account_created", "account_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"))
    email: Mapped[str] = mapped_column(String(254))
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    invited_by_user_id: Mapped[int | None] = mapped_column(ForeignKey("console_users.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    accepted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    accepted_by_user_id: Mapped[int | None] = mapped_column(ForeignKey("console_users.id"))


class AuditEntry(Base):
    """One admin write: who, when, what, and the resource before and after."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    actor_id: Mapped[int | None] = mapped_column(ForeignKey("admin_tokens.id"))
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    resource_type: Mapped[str] = mapped_column(String(32))
    resource_id: Mapped[str] = mapped_column(String(128))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The account a console member's action was in (its team's activity); None for platform-wide writes.
    account_id: Mapped[int | None] = mapped_column(Integer, index=True)


class StoredResponse(Base):
    """A finished ``POST /v1/responses`` answer kept for its account (``store``, the default): read back
    by id, and the conversation a later request continues with ``previous_response_id``. Any gateway
    process reads it; vLLM's own store is one worker's memory."""

    __tablename__ = "stored_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    # The ledger row of the request that produced it.
    request_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    # Indexed: the retention purge deletes by it.
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    # JSON text as it went out: the response object, and every input item the model was given (the
    # earlier turns' input and output items, then this request's input), which the next turn extends.
    response: Mapped[str] = mapped_column(Text)
    input_items: Mapped[str] = mapped_column(Text)


class StoredFile(Base):
    """A file of the Files API (``/v1/files``): its metadata here, its bytes in the gateway's file store
    under ``{account_id}/{id}``. Owned by one account; past ``expires_at`` it is gone for its owner and
    the gateway's sweeper deletes it."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_account_created", "account_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)


class FileUsage(Base):
    """What an account keeps in the Files API, changed in the same transaction as its ``files`` rows, so
    one conditional UPDATE holds both caps exactly across gateway processes."""

    __tablename__ = "file_usage"

    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), primary_key=True)
    files: Mapped[int] = mapped_column(Integer, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class Batch(Base):
    """A Batch API batch (``POST /v1/batches``): its progress lives in :class:`BatchLine` rows, so a
    gateway or worker restart resumes it where it stood."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"))
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"))
    # The OpenAI path its lines call: /v1/chat/completions or /v1/completions.
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING.value, index=True)
    # The client's metadata (up to 16 string pairs); errors: OpenAI's {"object": "list", "data": [...]}.
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    __table_args__ = (Index("ix_batches_account", "account_id", "created_at"),)


class BatchLineStatus(StrEnum):
    PENDING = "pending"
    # Its job is on the batch lane (or running): its result comes back on contract.BATCH_REPLIES.
    QUEUED = "queued"
    DONE = "done"
    FAILED = "failed"
    # Never run: its batch was cancelled or expired first.
    NOT_RUN = "not_run"


class BatchLine(Base):
    """One line of a batch's input file, and once it ran, its result (a line of the output or the
    error file)."""

    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    custom_id: Mapped[str] = mapped_column(String(512))
    model: Mapped[str] = mapped_column(String(128))
    # The request body as the worker gets it (JSON text).
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default=BatchLineStatus.PENDING.value)
    # The HTTP status and JSON body of its answer (or of its error), once it ran.
    status_code: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_batch_lines_status", "status", "batch_id"),)


class QuotaAlertSettings(Base):
    """An account's quota alerts, once its owner changed them (no row: 80 % and 100 % by email). The
    webhook's secret is kept as is: Flatfare signs each delivery with it, and the console shows it."""

    __tablename__ = "quota_alert_settings"

    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), primary_key=True)
    # Percents of the daily quota, ascending, each 1..100.
    thresholds: Mapped[list[int]] = mapped_column(JSON)
    email_enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    webhook_url: Mapped[str | None] = mapped_column(String(2048))
    webhook_secret: Mapped[str | None] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AlertStatus(StrEnum):
    PENDING = "pending"
    SENT = "sent"
    # Given up after FLATFARE_QUOTA_ALERTS_MAX_ATTEMPTS tries, or its channel was turned off meanwhile.
    FAILED = "failed"


class AlertChannel(StrEnum):
    EMAIL = "email"
    WEBHOOK = "webhook"


class QuotaAlertDelivery(Base):
    """One alert to send: an account's threshold crossed on a quota day, by one channel. The unique key
    makes it one row whichever gateway process saw the crossing first."""

    __tablename__ = "quota_alert_deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"))
    quota_day: Mapped[str] = mapped_column(String(10))
    threshold: Mapped[int] = mapped_column(Integer)
    channel: Mapped[str] = mapped_column(String(16))
    # The day's count and limit when the crossing was seen (what the alert says).
    used: Mapped[int] = mapped_column(Integer)
    daily_limit: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=AlertStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_error: Mapped[str | None] = mapped_column(String(512))

    __table_args__ = (UniqueConstraint("account_id", "quota_day", "threshold", "channel",
                                       name="uq_quota_alert_delivery"),
                      Index("ix_quota_alert_deliveries_due", "status", "next_attempt_at"))
