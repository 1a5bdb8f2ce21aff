"""What ``/metrics`` reports about the platform rather than about one gateway process: the queues and
pools of every model, the billing outbox, each plan's promise (its targets) and use today, and the
ledger's own checks (billing.checks). Read from Redis and SQL at scrape time, so every gateway replica
reports the same numbers: aggregate them with ``max``, not ``sum``.

Metric names are a contract with deploy/prometheus and deploy/grafana (tests/deploy checks it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from flatfare import contract
from flatfare.billing.checks import LedgerChecks, ledger_checks, quota_used
from flatfare.billing.plans import quota_window
from flatfare.contract import WorkerState
from flatfare.lanes.depth import QueueDepth, pool_queues
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import CatalogModel, OutboxStatus, Plan, UsageOutbox
from flatfare.gateway.app_state import Services

log = logging.getLogger("flatfare.gateway")

# The ledger's checks read the rows of the last day; a row still open this long past the request
# timeout was left by a process that died and was not reaped.
CHECKED_WINDOW = timedelta(days=1)
STUCK_SLACK_S = 300.0
# A quota day lasts 24 hours (25 across a daylight-saving change): its rows were all created since.
QUOTA_DAY_READ = timedelta(hours=25)

__all__ = ["LedgerWatch", "PlanState", "PlatformSnapshot", "PoolState", "QueueDepth", "SnapshotCollector",
           "plan_states", "platform_snapshot"]


@dataclass(frozen=True, slots=True)
class PoolState:
    live_workers: int
    pinned: bool
    min_workers: int
    capacity: int
    inflight: int
    # Live workers that take jobs now (not starting, waking, asleep or draining).
    warm_workers: int = 0


@dataclass(frozen=True, slots=True)
class PlanState:
    """A plan's promise and its use today."""

    ttft_target_s: float | None = None
    queue_wait_target_s: float | None = None
    daily_limit: int | None = None
    # Daily quota units in use on the plan in its current quota day (billable live requests).
    quota_used: int = 0


@dataclass(slots=True)
class PlatformSnapshot:
    """What ``/metrics`` reports about the platform rather than about this process."""

    queues: list[QueueDepth] = field(default_factory=list)
    # Per pool: PoolQueues.demand, what an external scaler (KEDA) sizes the pool on.
    demand: dict[str, int] = field(default_factory=dict)
    pools: dict[str, PoolState] = field(default_factory=dict)
    billing_enabled: bool = False
    outbox_pending: int | None = None
    outbox_oldest_age_s: float | None = None
    plans: dict[str, PlanState] = field(default_factory=dict)
    # The ledger's own checks over the last day (billing.checks); None while the database is away.
    ledger: LedgerChecks | None = None
    up: dict[str, bool] = field(default_factory=dict)


async def platform_snapshot(state: Services) -> PlatformSnapshot:
    """The queues and pools of every catalogued or served model, and the billing outbox's backlog."""
    settings = state.settings
    snapshot = PlatformSnapshot(billing_enabled=bool(settings.stripe_enabled))
    catalog: dict[str, tuple[bool, bool, int]] = {}
    now = datetime.now(UTC)
    try:
        async with state.sessions() as session:
            snapshot.plans, snapshot.ledger = await state.ledger_watch.read(session, settings, now)
            # A LoRA variant has no pool of its own: its requests queue in its base model's.
            for name, enabled, pinned, min_workers in (await session.execute(select(
                    CatalogModel.name, CatalogModel.enabled, CatalogModel.pinned, CatalogModel.min_workers)
                    .where(CatalogModel.base_model.is_(None)))).all():
                catalog[name] = (bool(enabled), bool(pinned), int(min_workers or 0))
            pending, oldest = (await session.execute(
                select(func.count(), func.min(UsageOutbox.created_at))
                .where(UsageOutbox.status == OutboxStatus.PENDING.value))).one()
        snapshot.outbox_pending = int(pending or 0)
        snapshot.outbox_oldest_age_s = 0.0
        if oldest is not None:
            snapshot.outbox_oldest_age_s = max((datetime.now(UTC) - oldest).total_seconds(), 0.0)
        snapshot.up["database"] = True
    except DATABASE_DOWN as exc:
        log.warning("metrics: could not read the catalog and the billing outbox (%s)", exc.__class__.__name__)
        snapshot.up["database"] = False
    try:
        seconds, micros = await state.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        served = {_text(m) for m in await state.redis.smembers(contract.POOLS_KEY)}
        # Every enabled pool of the catalog, served or not: one with no worker at all is what an
        # external scaler must see demand for to start its first.
        pools = [m for m in sorted(set(catalog) | served) if catalog.get(m, (True, False, 0))[0]]
        for model in pools:
            _, pinned, min_workers = catalog.get(model, (True, False, 0))
            workers = await state.pools.live_workers(model)
            snapshot.pools[model] = PoolState(len(workers), pinned, min_workers, sum(w.capacity for w in workers),
                                              sum(w.inflight for w in workers),
                                              sum(w.state is WorkerState.WARM for w in workers))
        for model, queues in (await pool_queues(state.redis, pools, now_ms)).items():
            snapshot.queues.extend(queues.lanes)
            snapshot.demand[model] = queues.demand
        snapshot.up["redis"] = True
    except REDIS_DOWN as exc:
        log.warning("metrics: could not read the queues (%s)", exc.__class__.__name__)
        snapshot.up["redis"] = False
    return snapshot


async def plan_states(session: Any, settings: Any, now: datetime) -> dict[str, PlanState]:
    """Every plan in use or with a target: its targets, daily limit and daily quota used today."""
    rows = (await session.execute(select(Plan.name, Plan.timezone, Plan.daily_limit)
                                  .where(Plan.retired.is_(False)))).all()
    days = {name: quota_window(timezone, now).day for name, timezone, _ in rows}
    used = await quota_used(session, days, now - QUOTA_DAY_READ)
    limits = {name: limit for name, _, limit in rows}
    ttft, wait = settings.plan_ttft_target_s, settings.plan_queue_wait_target_s
    return {name: PlanState(ttft.get(name), wait.get(name), limits.get(name), used.get(name, 0))
            for name in sorted(set(limits) | set(ttft) | set(wait))}


class LedgerWatch:
    """What a scrape reads of the last day's ledger rows (each plan's quota used, the ledger's checks),
    read at most once every ``every_s`` by each gateway process (0: at every scrape), so frequent
    scrapes of many replicas do not each read a day of rows."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: tuple[dict[str, PlanState], LedgerChecks] | None = None
        self._until = 0.0

    async def read(self, session: Any, settings: Any, now: datetime) -> tuple[dict[str, PlanState], LedgerChecks]:
        if self._last is not None and self._clock() < self._until:
            return self._last
        # A row open longer than a request may wait, plus the reaper's slack, is nobody's to settle.
        open_before = now - timedelta(seconds=settings.request_timeout_s + STUCK_SLACK_S)
        self._last = (await plan_states(session, settings, now),
                      await ledger_checks(session, now - CHECKED_WINDOW, open_before))
        self._until = self._clock() + self.every_s
        return self._last


class SnapshotCollector(Collector):
    def __init__(self, snapshot: PlatformSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self.snapshot
        yield from _queue_families(s.queues)
        demand = GaugeMetricFamily("flatfare_model_demand", "Requests that need a worker of the model's pool: "
                                   "waiting (both lanes, and routed to a worker's own stream) or taken and not "
                                   "finished. Scale a pool on it; above 0 with no worker, start one.",
                                   labels=["model"])
        for model, jobs in s.demand.items():
            demand.add_metric([model], jobs)
        yield demand
        live = GaugeMetricFamily("flatfare_pool_live_workers", "Workers of the model with a fresh heartbeat.",
                                 labels=["model", "pinned"])
        warm = GaugeMetricFamily("flatfare_pool_warm_workers", "Live workers of the model that take jobs now (not "
                                 "starting, waking, asleep or draining).", labels=["model", "pinned"])
        wanted = GaugeMetricFamily("flatfare_pool_min_workers", "Workers the catalog wants for the model.",
                                   labels=["model"])
        capacity = GaugeMetricFamily("flatfare_pool_capacity", "Jobs the model's live workers can hold at once.",
                                     labels=["model"])
        inflight = GaugeMetricFamily("flatfare_pool_inflight", "Jobs the model's live workers hold now.",
                                     labels=["model"])
        for model, pool in s.pools.items():
            live.add_metric([model, "true" if pool.pinned else "false"], pool.live_workers)
            warm.add_metric([model, "true" if pool.pinned else "false"], pool.warm_workers)
            wanted.add_metric([model], pool.min_workers)
            capacity.add_metric([model], pool.capacity)
            inflight.add_metric([model], pool.inflight)
        yield from (live, warm, wanted, capacity, inflight)
        yield GaugeMetricFamily("flatfare_billing_enabled", "1 when usage is reported to Stripe (the outbox is "
                                "being sent), 0 when billing is off.", value=1.0 if s.billing_enabled else 0.0)
        if s.outbox_pending is not None:
            yield GaugeMetricFamily("flatfare_billing_outbox_pending", "Meter events waiting to be sent to Stripe.",
                                    value=s.outbox_pending)
            yield GaugeMetricFamily("flatfare_billing_outbox_oldest_age_seconds", "Age of the oldest meter event "
                                    "waiting to be sent (0 when none waits).", value=s.outbox_oldest_age_s or 0.0)
        yield from _plan_families(s.plans)
        if s.ledger is not None:
            yield from _ledger_families(s.ledger)
        up = GaugeMetricFamily("flatfare_dependency_up", "Whether the gateway could read this dependency when "
                               "scraped.", labels=["dependency"])
        for name, ok in s.up.items():
            up.add_metric([name], 1.0 if ok else 0.0)
        yield up


def _plan_families(plans: dict[str, PlanState]) -> Iterator[GaugeMetricFamily]:
    ttft = GaugeMetricFamily("flatfare_plan_ttft_target_seconds", "The time to first token the plan's requests "
                             "should stay under at p99 (FLATFARE_PLAN_TTFT_TARGET_S).", labels=["plan"])
    wait = GaugeMetricFamily("flatfare_plan_queue_wait_target_seconds", "The queue wait the plan's requests should "
                             "stay under at p99 (FLATFARE_PLAN_QUEUE_WAIT_TARGET_S).", labels=["plan"])
    limit = GaugeMetricFamily("flatfare_plan_daily_limit_requests", "Requests an account of the plan may make a "
                              "day (absent: no limit).", labels=["plan"])
    used = GaugeMetricFamily("flatfare_plan_quota_used_requests", "Daily quota units in use on the plan in its "
                             "current quota day: billable live requests, open ones included (Batch API lines have "
                             "an allowance of their own).", labels=["plan"])
    for name, plan in plans.items():
        if plan.ttft_target_s is not None:
            ttft.add_metric([name], plan.ttft_target_s)
        if plan.queue_wait_target_s is not None:
            wait.add_metric([name], plan.queue_wait_target_s)
        if plan.daily_limit is not None:
            limit.add_metric([name], plan.daily_limit)
        used.add_metric([name], plan.quota_used)
    yield from (ttft, wait, limit, used)


def _ledger_families(checks: LedgerChecks) -> Iterator[GaugeMetricFamily]:
    mismatch = GaugeMetricFamily("flatfare_billing_ledger_meter_mismatch", "Ledger rows of the last day whose "
                                 "meter event is missing (unmetered: billable and priced, no event) or wrong "
                                 "(overmetered: an event for a free row). 0 when the ledger and the meter agree.",
                                 labels=["kind"])
    mismatch.add_metric(["unmetered"], checks.unmetered)
    mismatch.add_metric(["overmetered"], checks.overmetered)
    yield mismatch
    yield GaugeMetricFamily("flatfare_ledger_stuck_requests", "Ledger rows of the last day still open past the "
                            "longest a request may take: requests no process will settle.", value=checks.stuck_open)


def _queue_families(queues: list[QueueDepth]) -> Iterator[GaugeMetricFamily]:
    depth = GaugeMetricFamily("flatfare_queue_depth", "Jobs waiting for a worker.", labels=["model", "lane"])
    claimed = GaugeMetricFamily("flatfare_queue_claimed", "Jobs a worker has taken and not finished.",
                                labels=["model", "lane"])
    oldest = GaugeMetricFamily("flatfare_queue_oldest_wait_seconds", "How long the oldest waiting job has "
                               "waited (0 when none waits).", labels=["model", "lane"])
    for q in queues:
        depth.add_metric([q.model, q.lane], q.waiting)
        claimed.add_metric([q.model, q.lane], q.claimed)
        oldest.add_metric([q.model, q.lane], q.oldest_wait_s)
    yield from (depth, claimed, oldest)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
