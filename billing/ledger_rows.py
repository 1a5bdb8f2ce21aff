"""What a request writes when it is recorded and when it ends, in one transaction: its ledger row, the
Stripe outbox row of a billable priced one (on its meter), and the usage rollup's deltas.

This is the one writer of those rows. :class:`~flatfare.billing.ledger.Ledger` runs :func:`write_batch`
for live requests (group-committed: a row opened when the request is queued, closed when it ends);
the batch collector runs it through :func:`record_batch_lines` for Batch API lines, which are
recorded once finished, in the collector's own transaction (with the lines' states); the outbox's
reconciliation builds its repairs with :func:`outbox_row`. The statements are an interface
(:class:`Statements`): SQLAlchemy Core here (:class:`CoreStatements`), prepared ``sqlite3`` statements
on a SQLite file (:mod:`flatfare.billing.ledger_sqlite`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import Connection, bindparam, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.billing.plans import PlanRules, batch_line_price, effective_plan_name, quota_window
from flatfare.billing.rollup import UPSERT_ACCOUNT, UPSERT_PLATFORM, Rollup, day_of
from flatfare.contract import Usage
from flatfare.storage.models import Account, Meter, OutboxStatus, Plan, RequestRecord, RequestStatus, UsageOutbox

# Ledger rows of Batch API lines name their endpoint "batch:<kind>": they count on the plan's batch
# allowance, not on the live daily quota, whose counters are rebuilt from the other billable rows, and
# go to Stripe on the batch meter.
BATCH_ENDPOINT_PREFIX = "batch:"

_REQUESTS = RequestRecord.__table__
_OUTBOX = UsageOutbox.__table__
# What a close reads of each row still queued (the rollup needs its key, model and day; the outbox
# row its meter, from the endpoint).
QUEUED_COLUMNS = ("id", "billable", "price_micros", "account_id", "quota_day", "api_key_id", "model", "created_at",
                  "endpoint")
# The columns of an outbox row, as :func:`outbox_row` writes them.
METER_COLUMNS = ("request_id", "account_id", "day", "created_at", "status", "attempts", "next_attempt_at", "meter")

_OPEN = insert(_REQUESTS)
_CLOSE = (update(_REQUESTS)
          .where(_REQUESTS.c.id == bindparam("b_id"), _REQUESTS.c.status == RequestStatus.QUEUED.value)
          .values(status=bindparam("b_status"), http_status=bindparam("b_http_status"),
                  finished_at=bindparam("b_finished_at"), queue_ms=bindparam("b_queue_ms"),
                  ttft_ms=bindparam("b_ttft_ms"), duration_ms=bindparam("b_duration_ms"),
                  prompt_tokens=bindparam("b_prompt_tokens"), completion_tokens=bindparam("b_completion_tokens"),
                  error_code=bindparam("b_error_code"), billable=bindparam("b_billable")))
_METER = insert(_OUTBOX)
_ROLLUP_ACCOUNT = text(UPSERT_ACCOUNT)
_ROLLUP_PLATFORM = text(UPSERT_PLATFORM)


@dataclass(frozen=True, slots=True)
class Charge:
    """What an admitted request costs: the plan's flat price, whatever its length."""

    plan: str
    price_micros: int
    quota_day: str


@dataclass(slots=True)
class Outcome:
    status: RequestStatus
    http_status: int
    queue_ms: int | None = None
    ttft_ms: int | None = None
    duration_ms: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    # False when the request failed before its first token: its quota unit is given back.
    billable: bool = True


@dataclass(slots=True)
class Write:
    """One request's part of a transaction: its new row (an open), its end (a close), or both."""

    request_id: str
    opening: dict[str, object] | None
    outcome: Outcome | None
    # The ledger's group commit: done once the transaction with this write is committed.
    done: asyncio.Future[None] | None = None


def opening_row(*, request_id: str, account_id: int, api_key_id: int, model: str, endpoint: str, stream: bool,
                created_at: datetime, charge: Charge | None = None, idempotency_key: str | None = None,
                body_sha256: str | None = None) -> dict[str, object]:
    """A request's ledger row as it is opened: queued, billable at its plan's price if it was charged."""
    return {"id": request_id, "account_id": account_id, "api_key_id": api_key_id, "model": model,
            "endpoint": endpoint, "stream": stream, "status": RequestStatus.QUEUED.value,
            "created_at": created_at, "prompt_tokens": 0, "completion_tokens": 0,
            "billable": charge is not None, "price_micros": charge.price_micros if charge else 0,
            "plan": charge.plan if charge else None, "quota_day": charge.quota_day if charge else None,
            "idempotency_key": idempotency_key, "body_sha256": body_sha256}


def meter_of(endpoint: str) -> Meter:
    """The Stripe meter a billable row goes to: Batch API lines at the batch price, the rest per request."""
    return Meter.BATCH if endpoint.startswith(BATCH_ENDPOINT_PREFIX) else Meter.REQUESTS


def outbox_row(request_id: str, account_id: int, day: str, now: datetime, endpoint: str) -> dict[str, Any]:
    """The meter event a billable priced row owes Stripe, due now."""
    return {"request_id": request_id, "account_id": account_id, "day": day, "created_at": now,
            "status": OutboxStatus.PENDING.value, "attempts": 0, "next_attempt_at": now,
            "meter": meter_of(endpoint).value}


class Statements(Protocol):
    """The statements of a ledger transaction, on one open transaction."""

    def insert_opens(self, rows: list[dict[str, Any]]) -> None: ...

    def queued(self, ids: list[str]) -> list[tuple[Any, ...]]:
        """The rows among ``ids`` still queued: the columns of :data:`QUEUED_COLUMNS`."""

    def close_rows(self, updates: list[dict[str, Any]]) -> None: ...

    def insert_meters(self, meters: list[dict[str, Any]]) -> None: ...

    def add_usage(self, rollup: Rollup) -> None: ...


class CoreStatements:
    """The statements as SQLAlchemy Core, for any database (asyncpg's PostgreSQL, through run_sync)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def insert_opens(self, rows: list[dict[str, Any]]) -> None:
        self._conn.execute(_OPEN, rows)

    def queued(self, ids: list[str]) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._conn.execute(
            select(*(_REQUESTS.c[name] for name in QUEUED_COLUMNS))
            .where(_REQUESTS.c.id.in_(ids), _REQUESTS.c.status == RequestStatus.QUEUED.value)
            .with_for_update())]

    def close_rows(self, updates: list[dict[str, Any]]) -> None:
        self._conn.execute(_CLOSE, [{f"b_{k}": v for k, v in u.items()} for u in updates])

    def insert_meters(self, meters: list[dict[str, Any]]) -> None:
        self._conn.execute(_METER, meters)

    def add_usage(self, rollup: Rollup) -> None:
        if rollup:
            self._conn.execute(_ROLLUP_ACCOUNT, rollup.account_rows())
            self._conn.execute(_ROLLUP_PLATFORM, rollup.platform_rows())


def write_batch(db: Statements, batch: list[Write]) -> None:
    """One transaction's statements (the caller begins and commits it)."""
    opens = [w.opening for w in batch if w.opening is not None]
    closes: dict[str, Outcome] = {}
    for write in batch:
        if write.outcome is not None:
            closes.setdefault(write.request_id, write.outcome)  # the first close of a row wins
    now = datetime.now(UTC)
    rollup = Rollup()
    if opens:
        db.insert_opens(opens)
        for row in opens:
            rollup.opened(row)
    queued = db.queued(list(closes)) if closes else []
    updates, meters = [], []
    for row in queued:
        request_id, row_billable, price_micros, account_id, quota_day = row[:5]
        outcome = closes[request_id]
        billable = bool(row_billable) and outcome.billable
        if row_billable and not billable:
            made_free(rollup, row)
        updates.append({
            "id": request_id, "status": outcome.status.value, "http_status": outcome.http_status,
            "finished_at": now, "queue_ms": outcome.queue_ms, "ttft_ms": outcome.ttft_ms,
            "duration_ms": outcome.duration_ms, "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens, "error_code": outcome.error_code,
            "billable": billable})
        if billable and price_micros > 0:
            meters.append(outbox_row(request_id, account_id, quota_day or "", now, row[8]))
    if updates:
        db.close_rows(updates)
    if meters:
        db.insert_meters(meters)
    db.add_usage(rollup)


def made_free(rollup: Rollup, row: tuple[Any, ...]) -> None:
    """A queued billable row (the columns of :data:`QUEUED_COLUMNS`) closing free."""
    _, _, price_micros, account_id, quota_day, api_key_id, model, created_at = row[:8]
    rollup.made_free(account_id=account_id, api_key_id=api_key_id, model=model,
                     day=day_of(quota_day, created_at), price_micros=price_micros)


# -- Batch API lines -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FinishedLine:
    """A Batch API line whose job ended: ``answered`` (the engine answered it) bills it at its plan's
    batch price; a line that failed is free."""

    request_id: str
    account_id: int
    api_key_id: int
    model: str
    # The kind it called ("chat", "embeddings"...): its row's endpoint is "batch:<kind>".
    kind: str
    answered: bool
    http_status: int
    usage: Usage | None = None


async def record_batch_lines(session: AsyncSession, lines: list[FinishedLine]) -> None:
    """Write finished batch lines' ledger rows, outbox rows (on the batch meter, at the batch price) and
    rollup deltas in ``session``'s transaction, through :func:`write_batch`: each row opened and
    closed in the one transaction. Each account's plan is the one in effect now (a trial that ended
    is Free), read once."""
    now = datetime.now(UTC)
    pricing: dict[int, tuple[PlanRules, str]] = {}
    writes = []
    for line in lines:
        if line.account_id not in pricing:
            account = await session.get(Account, line.account_id)
            assert account is not None  # batches reference their account
            plan = await session.get(Plan, effective_plan_name(account, now))
            assert plan is not None
            pricing[line.account_id] = (PlanRules.from_row(plan), quota_window(plan.timezone, now).day)
        plan_rules, day = pricing[line.account_id]
        price = batch_line_price(plan_rules) if line.answered else 0
        usage = line.usage or Usage()
        opening = opening_row(request_id=line.request_id, account_id=line.account_id, api_key_id=line.api_key_id,
                              model=line.model, endpoint=BATCH_ENDPOINT_PREFIX + line.kind, stream=False,
                              created_at=now, charge=Charge(plan_rules.name, price, day))
        outcome = Outcome(RequestStatus.SUCCEEDED if line.answered else RequestStatus.FAILED, line.http_status,
                          prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                          billable=line.answered)
        writes.append(Write(line.request_id, opening, outcome))
    connection = await session.connection()
    await connection.run_sync(lambda sync: write_batch(CoreStatements(sync), writes))
