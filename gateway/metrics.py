"""The gateway's Prometheus metrics, the middleware that records every request, and ``GET /metrics``.

Gateway processes (``flatfare gateway --processes N``) share one port, so the counters and histograms
use prometheus_client's multiprocess mode: each process writes its samples to files in
``PROMETHEUS_MULTIPROC_DIR`` (the ``gateway`` command makes a fresh one) and ``/metrics`` adds them up,
whichever process answers the scrape. Values about the platform as a whole (queue depth, live workers,
the billing outbox) are read from Redis and SQL at scrape time, so every gateway replica reports the
same numbers for them: aggregate those with ``max``, not ``sum``.

Metric names are a contract with deploy/prometheus and deploy/grafana (tests/deploy checks it).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psutil
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flatfare import contract
from flatfare.queues import QueueDepth, pool_queues
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import CatalogModel, OutboxStatus, UsageOutbox

log = logging.getLogger("flatfare.gateway")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Routes whose requests are logged at DEBUG only: probes and scrapes would drown the API's lines.
_QUIET_ROUTES = frozenset({"/metrics", "/healthz", "/readyz"})
UNMATCHED_ROUTE = "unmatched"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    """Every metric a gateway process writes. One instance per app; in multiprocess mode the samples
    land in files and the ``registry`` only matters for a single-process gateway."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("flatfare_requests", "HTTP requests answered, by route template, status, "
                                "plan and model.", ["route", "status", "plan", "model"], registry=r)
        self.request_duration = Histogram(
            "flatfare_request_duration_seconds", "End-to-end latency: request received to last byte sent.",
            ["route", "model", "lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_progress = Gauge("flatfare_requests_in_progress", "HTTP requests being handled now.",
                                 multiprocess_mode="livesum", registry=r)
        self.time_to_first_token = Histogram(
            "flatfare_time_to_first_token_seconds", "Request received to its first output reaching the "
            "gateway (whole answer for non-streaming requests).", ["model", "lane"], buckets=TTFT_BUCKETS,
            registry=r)
        self.queue_wait = Histogram(
            "flatfare_queue_wait_seconds", "Request received to a worker taking its job.", ["model", "lane"],
            buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.completions = Counter("flatfare_completions", "Completion requests finished, by ledger outcome "
                                   "(succeeded, failed, cancelled).", ["model", "lane", "outcome"], registry=r)
        self.output_tokens = Counter("flatfare_output_tokens", "Output (completion) tokens delivered; "
                                     "rate() gives tokens per second.", ["model", "lane"], registry=r)
        self.prompt_tokens = Counter("flatfare_prompt_tokens", "Prompt tokens processed.", ["model", "lane"],
                                     registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.quota_rejections = Counter("flatfare_quota_rejections", "Requests refused with 429 because the "
                                        "account's daily allowance was spent.", ["plan"], registry=r)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: prometheus_client resolves a label set under a lock
        on every call, several times a request. Label values are bounded (checked routes, models,
        plans, statuses), so the cache is too."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def first_token(self, model: str, lane: str, seconds: float) -> None:
        self.child(self.time_to_first_token, model, lane).observe(max(seconds, 0.0))

    def finished(self, model: str, lane: str, outcome: str, *, queue_ms: int | None, prompt_tokens: int,
                 completion_tokens: int) -> None:
        """A request's ledger row was closed with ``outcome``."""
        self.child(self.completions, model, lane, outcome).inc()
        if queue_ms is not None:
            self.child(self.queue_wait, model, lane).observe(queue_ms / 1000)
        if completion_tokens:
            self.child(self.output_tokens, model, lane).inc(completion_tokens)
        if prompt_tokens:
            self.child(self.prompt_tokens, model, lane).inc(prompt_tokens)

    def quota_rejected(self, plan: str) -> None:
        self.quota_rejections.labels(plan).inc()


class RequestObserver:
    """ASGI middleware: counts and times every HTTP request, and writes one log line for it."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response: dict[str, Any] = {"status": 500, "request_id": None}

        async def observe_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        response["request_id"] = value.decode()
            await send(message)

        self.metrics.in_progress.inc()
        try:
            await self.app(scope, receive, observe_send)
        finally:
            self.metrics.in_progress.dec()
            matched = scope.get("route")
            route = getattr(matched, "path", None) or UNMATCHED_ROUTE
            self._record(scope, route, response, time.perf_counter() - started)

    def _record(self, scope: Scope, route: str, response: dict[str, Any], seconds: float) -> None:
        state = scope.get("state") or {}
        caller = state.get("caller")
        plan = caller.account.plan if caller is not None else ""
        observe(self.metrics, scope.get("method", ""), route, response["status"], seconds,
                request_id=response["request_id"], caller=caller, plan=plan)


def observe(metrics: GatewayMetrics, method: str, route: str, status: int, seconds: float, *,
            request_id: str | None, caller: Any, plan: str = "", model: str = "", lane: str = "") -> None:
    """Count and time one answered HTTP request, and write its log line."""
    metrics.child(metrics.requests, route, str(status), plan, model).inc()
    metrics.child(metrics.request_duration, route, model, lane).observe(seconds)
    level = logging.DEBUG if route in _QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        fields = {"status": status, "duration_ms": round(seconds * 1000, 1), "route": route,
                  "request_id": request_id, "account": caller.account_name if caller else None,
                  "plan": plan, "model": model}
        log.log(level, "%s %s %s", method, route, status, extra={k: v for k, v in fields.items() if v})


# -- scrape time: the platform's state, read from Redis and SQL ---------------------------------


@dataclass(frozen=True, slots=True)
class PoolState:
    live_workers: int
    pinned: bool
    min_workers: int
    capacity: int
    inflight: int


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
    up: dict[str, bool] = field(default_factory=dict)


async def platform_snapshot(state: Any) -> PlatformSnapshot:
    """The queues and pools of every catalogued or served model, and the billing outbox's backlog."""
    snapshot = PlatformSnapshot(billing_enabled=bool(state.settings.stripe_enabled))
    catalog: dict[str, tuple[bool, bool, int]] = {}
    try:
        async with state.sessions() as session:
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
                                              sum(w.inflight for w in workers))
        for model, queues in (await pool_queues(state.redis, pools, now_ms)).items():
            snapshot.queues.extend(queues.lanes)
            snapshot.demand[model] = queues.demand
        snapshot.up["redis"] = True
    except REDIS_DOWN as exc:
        log.warning("metrics: could not read the queues (%s)", exc.__class__.__name__)
        snapshot.up["redis"] = False
    return snapshot


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
        wanted = GaugeMetricFamily("flatfare_pool_min_workers", "Workers the catalog wants for the model.",
                                   labels=["model"])
        capacity = GaugeMetricFamily("flatfare_pool_capacity", "Jobs the model's live workers can hold at once.",
                                     labels=["model"])
        inflight = GaugeMetricFamily("flatfare_pool_inflight", "Jobs the model's live workers hold now.",
                                     labels=["model"])
        for model, pool in s.pools.items():
            live.add_metric([model, "true" if pool.pinned else "false"], pool.live_workers)
            wanted.add_metric([model], pool.min_workers)
            capacity.add_metric([model], pool.capacity)
            inflight.add_metric([model], pool.inflight)
        yield from (live, wanted, capacity, inflight)
        yield GaugeMetricFamily("flatfare_billing_enabled", "1 when usage is reported to Stripe (the outbox is "
                                "being sent), 0 when billing is off.", value=1.0 if s.billing_enabled else 0.0)
        if s.outbox_pending is not None:
            yield GaugeMetricFamily("flatfare_billing_outbox_pending", "Meter events waiting to be sent to Stripe.",
                                    value=s.outbox_pending)
            yield GaugeMetricFamily("flatfare_billing_outbox_oldest_age_seconds", "Age of the oldest meter event "
                                    "waiting to be sent (0 when none waits).", value=s.outbox_oldest_age_s or 0.0)
        up = GaugeMetricFamily("flatfare_dependency_up", "Whether the gateway could read this dependency when "
                               "scraped.", labels=["dependency"])
        for name, ok in s.up.items():
            up.add_metric([name], 1.0 if ok else 0.0)
        yield up


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


_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


def forget_dead_processes(path: str) -> None:
    """Drop the live gauges of gateway processes that died (a crashed process uvicorn replaced)."""
    for name in glob.glob(os.path.join(path, "gauge_live*.db")):
        match = _LIVE_GAUGE_FILE.search(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            multiprocess.mark_process_dead(int(match.group(1)), path)


def exposition(metrics: GatewayMetrics, snapshot: PlatformSnapshot) -> bytes:
    multiproc_dir = os.environ.get(MULTIPROC_ENV)
    if multiproc_dir:
        forget_dead_processes(multiproc_dir)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, multiproc_dir)
        registry.register(SnapshotCollector(snapshot))
        return generate_latest(registry)
    return generate_latest(metrics.registry) + generate_latest(_single(SnapshotCollector(snapshot)))


def _single(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


router = APIRouter(tags=["operations"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus metrics of every process of this gateway, plus the platform's queues and outbox."""
    state = request.app.state
    snapshot = await platform_snapshot(state)
    return Response(exposition(state.metrics, snapshot), media_type=CONTENT_TYPE_LATEST)
