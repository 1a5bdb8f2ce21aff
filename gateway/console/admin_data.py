"""What the admin console's pages read: accounts, their keys and usage, the catalog's live state, the
platform's usage per day and the audit log. Reads only: every write is :mod:`flatfare.gateway.admin.services`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, or_, select

from flatfare import contract
from flatfare.billing import rollup
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import QuotaUnavailable
from flatfare.contract import WorkerInfo, WorkerState
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.models import Account, ApiKey, AuditEntry, CatalogModel, ConsoleUser, Plan
from flatfare.lanes.depth import QueueDepth, pool_queues
from flatfare.gateway.app_state import Services
from flatfare.gateway.metrics import process_samples
from flatfare.gateway.plan_figures import PlanFigures, plan_figures
from flatfare.gateway.platform_metrics import plan_states

PAGE_SIZE = 50
# What an account search may be: a name or an email is well within this.
MAX_QUERY_CHARS = 128
USAGE_DAYS = 30


async def find_accounts(session: Any, query: str = "", *, after: int | None = None,
                        limit: int = PAGE_SIZE) -> tuple[list[Account], int | None]:
    """Accounts whose name, or one of whose console users' email, contains ``query``, by id; and the
    cursor of the next page (None: the last page)."""
    statement = select(Account).order_by(Account.id).limit(limit + 1)
    query = query.strip()[:MAX_QUERY_CHARS]
    if query:
        by_email = select(ConsoleUser.account_id).where(ConsoleUser.email.contains(query.lower(), autoescape=True))
        statement = statement.where(or_(Account.name.contains(query, autoescape=True), Account.id.in_(by_email)))
    if after is not None:
        statement = statement.where(Account.id > after)
    rows = list(await session.scalars(statement))
    return rows[:limit], rows[limit - 1].id if len(rows) > limit else None


async def emails_of(session: Any, account_ids: list[int]) -> dict[int, list[str]]:
    """The console users' emails of each account."""
    found: dict[int, list[str]] = {account_id: [] for account_id in account_ids}
    if account_ids:
        rows = await session.execute(select(ConsoleUser.account_id, ConsoleUser.email)
                                     .where(ConsoleUser.account_id.in_(account_ids)).order_by(ConsoleUser.id))
        for account_id, email in rows:
            found[account_id].append(email)
    return found


async def live_key_counts(session: Any, account_ids: list[int]) -> dict[int, int]:
    """Each account's keys that are not revoked."""
    if not account_ids:
        return {}
    rows = await session.execute(select(ApiKey.account_id, func.count())
                                 .where(ApiKey.account_id.in_(account_ids), ApiKey.revoked_at.is_(None))
                                 .group_by(ApiKey.account_id))
    return dict(rows.all())


@dataclass(frozen=True, slots=True)
class PlatformCounts:
    accounts: int
    inactive: int  # suspended or past due
    live_keys: int


async def platform_counts(session: Any) -> PlatformCounts:
    accounts = await session.scalar(select(func.count()).select_from(Account))
    inactive = await session.scalar(select(func.count()).select_from(Account).where(Account.status != "active"))
    keys = await session.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None)))
    return PlatformCounts(int(accounts or 0), int(inactive or 0), int(keys or 0))


@dataclass
class AccountView:
    account: Account
    keys: list[ApiKey]
    emails: list[str]
    plans: list[Plan]
    effective_plan: str
    daily_limit: int | None
    used_today: int | None  # None: Redis did not answer
    day: str
    history: list[rollup.DayUsage]
    by_model: list[dict[str, Any]]


async def account_view(state: Services, account_id: int) -> AccountView | None:
    now = datetime.now(UTC)
    async with state.sessions() as session:
        account = await session.get(Account, account_id)
        if account is None:
            return None
        keys = list(await session.scalars(select(ApiKey).where(ApiKey.account_id == account_id)
                                          .order_by(ApiKey.id.desc()).limit(200)))
        plans = list(await session.scalars(select(Plan).order_by(Plan.name)))
        emails = (await emails_of(session, [account_id]))[account_id]
        terms = await state.plans.terms(account, now)
        window = quota_window(terms.plan.timezone, now)
        days = rollup.days_back(window.day, USAGE_DAYS)
        history = await rollup.account_daily(session, account_id, days)
        by_model = await rollup.account_by_model(session, account_id, days[0], days[-1])
    try:
        used: int | None = await state.quota.used(account_id, window.day)
    except QuotaUnavailable:  # the page still shows the rest; today's count reads "unknown"
        used = None
    return AccountView(account, keys, emails, plans, terms.plan.name, terms.daily_limit, used, window.day, history,
                       by_model)


@dataclass
class ModelRow:
    name: str
    source: str
    enabled: bool
    pinned: bool
    min_workers: int
    in_catalog: bool
    warmth: str
    # None: its fleet's default idle timeout.
    idle_timeout_s: int | None = None
    # A LoRA variant's base model: the variant is served by the base's pool (its workers and queues).
    base_model: str | None = None
    workers: list[WorkerInfo] = field(default_factory=list)
    queues: dict[str, QueueDepth] = field(default_factory=dict)
    # Requests that need a worker of its pool (what /metrics reports as flatfare_model_demand).
    demand: int = 0
    requests_today: int = 0
    billable_today: int = 0

    @property
    def pool(self) -> str:
        return self.base_model or self.name

    @property
    def kept(self) -> str:
        """How its engines are kept: pinned (always up), on demand, or as a variant of its base."""
        if self.base_model:
            return "variant"
        return "pinned" if self.pinned or self.min_workers > 0 else "on demand"

    @property
    def capacity(self) -> int:
        return sum(w.capacity for w in self.workers)

    @property
    def inflight(self) -> int:
        return sum(w.inflight for w in self.workers)


def warmth(workers: list[WorkerInfo], expected: bool) -> str:
    """Its pool's most awake worker's state (warm, waking, starting, draining, sleeping, asleep); with
    none, unavailable (pinned, so it should have one) or cold (on demand: started when asked for)."""
    states = {w.state for w in workers}
    for state in (WorkerState.WARM, WorkerState.WAKING, WorkerState.STARTING, WorkerState.DRAINING,
                  WorkerState.SLEEPING, WorkerState.ASLEEP):
        if state in states:
            return state.value
    return "unavailable" if expected else "cold"


async def model_rows(state: Services) -> tuple[list[ModelRow], bool]:
    """Every catalog model and every pool served outside it, with its live workers, each lane's
    queue (as ``/metrics`` reports it) and its requests today (UTC); and whether Redis answered."""
    today = datetime.now(UTC).date().isoformat()
    async with state.sessions() as session:
        catalog = list(await session.scalars(select(CatalogModel).order_by(CatalogModel.name)))
        today_by_model = await rollup.platform_by_model(session, today, today)
    rows = {m.name: ModelRow(m.name, m.source, m.enabled, m.pinned, m.min_workers, True, "cold", m.idle_timeout_s,
                             m.base_model) for m in catalog}
    redis_up = True
    try:
        served = {m.decode() if isinstance(m, bytes) else m for m in await state.redis.smembers(contract.POOLS_KEY)}
        for name in sorted(served - set(rows)):
            rows[name] = ModelRow(name, "", True, False, 0, False, "cold")
        seconds, micros = await state.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        queues = await pool_queues(state.redis, sorted({row.pool for row in rows.values()}), now_ms)
        for row in rows.values():
            row.workers = list(await state.pools.live_workers(row.pool))
            row.queues = {q.lane: q for q in queues[row.pool].lanes}
            row.demand = queues[row.pool].demand
    except REDIS_DOWN:
        redis_up = False
    for row in rows.values():
        row.warmth = warmth(row.workers, row.enabled and row.kept == "pinned")
        usage = today_by_model.get(row.name)
        if usage is not None:
            row.requests_today, row.billable_today = usage.requests, usage.billable_requests
    return sorted(rows.values(), key=lambda r: (not r.in_catalog, r.name)), redis_up


async def plan_rows(state: Services) -> list[PlanFigures]:
    """Each plan's promise and this gateway's figures for it since it started (the dashboard's table)."""
    async with state.sessions() as session:
        plans = await plan_states(session, state.settings, datetime.now(UTC))
    return plan_figures(process_samples(state.metrics), plans)


async def platform_usage(state: Services, days: int) -> list[rollup.DayUsage]:
    """The platform's requests, billable requests and billable revenue per UTC day, oldest first."""
    today = datetime.now(UTC).date().isoformat()
    async with state.sessions() as session:
        return await rollup.platform_daily(session, rollup.days_back(today, days))


async def audit_page(session: Any, *, before: int | None = None, action: str = "",
                     limit: int = PAGE_SIZE) -> tuple[list[AuditEntry], int | None]:
    """Audit entries newest first, from just below ``before``; and the next page's cursor."""
    statement = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit + 1)
    if before is not None:
        statement = statement.where(AuditEntry.id < before)
    if action:
        statement = statement.where(AuditEntry.action == action[:64])
    rows = list(await session.scalars(statement))
    return rows[:limit], rows[limit - 1].id if len(rows) > limit else None


def ms_ago(started_ms: int) -> float:
    return max(time.time() * 1000 - started_ms, 0) / 1000
