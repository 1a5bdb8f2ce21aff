"""The gateway's Prometheus metrics, the middleware that records every request, and ``GET /metrics``.

Gateway processes (``flatfare gateway --processes N``) share one port, so the counters and histograms
use prometheus_client's multiprocess mode: each process writes its samples to files in
``PROMETHEUS_MULTIPROC_DIR`` (the ``gateway`` command makes a fresh one) and ``/metrics`` adds them up,
whichever process answers the scrape. Values about the platform as a whole (queue depth, live workers,
the billing outbox, each plan's targets, the ledger's checks) are gateway/platform_metrics.py's, read
from Redis and SQL at scrape time.

Metric names are a contract with deploy/prometheus and deploy/grafana (tests/deploy checks it).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from typing import Any

import orjson
import psutil
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flatfare import tracecontext
from flatfare.tracing import Tracer
from flatfare.gateway.app_state import services_of
from flatfare.logs import log_context
from flatfare.gateway.platform_metrics import PlatformSnapshot, SnapshotCollector, platform_snapshot
from flatfare.loop_tasks import EventLoopTasks

log = logging.getLogger("flatfare.gateway")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Routes whose requests are logged at DEBUG only: probes and scrapes would drown the API's lines.
_QUIET_ROUTES = frozenset({"/metrics", "/healthz", "/readyz"})
UNMATCHED_ROUTE = "unmatched"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# An engine's start or wake: seconds (a sleeping engine) to minutes (a cold start that loads weights).
COLD_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# An error code is a label: what is not a short snake_case word (an engine's own text) is counted as "other".
_ERROR_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


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
            "gateway (whole answer for non-streaming requests).", ["model", "lane", "plan"],
            buckets=TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "flatfare_queue_wait_seconds", "Request received to a worker taking its job.", ["model", "lane", "plan"],
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
        self.refusals = Counter("flatfare_refusals", "Error answers (4xx and 5xx) by plan, status and the error "
                                "body's code (\"\" when it has none).", ["plan", "status", "code"], registry=r)
        self.cold_start_wait = Histogram(
            "flatfare_cold_start_wait_seconds", "Requests admitted while their model had no warm worker (asleep, "
            "waking, starting or none): request received to a worker taking the job.", ["model", "plan"],
            buckets=COLD_START_BUCKETS, registry=r)
        self.requests_lost = Counter("flatfare_requests_lost", "Requests that ended without their answer: their "
                                     "job lost with Redis's data (job_lost) or their gateway process died "
                                     "(gateway_lost). Free, but the client saw an error or nothing.", ["reason"],
                                     registry=r)
        for reason in ("job_lost", "gateway_lost"):  # at 0 from the start, so the first loss is an increase
            self.requests_lost.labels(reason)
        self.batch_lines = Counter("flatfare_batch_lines", "Batch API lines recorded, by outcome (done: the engine "
                                   "answered, billed; failed: free).", ["model", "outcome"], registry=r)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: prometheus_client resolves a label set under a lock
        on every call, several times a request. Label values are bounded (checked routes, models,
        plans, statuses), so the cache is too."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def first_token(self, model: str, lane: str, plan: str, seconds: float) -> None:
        self.child(self.time_to_first_token, model, lane, plan).observe(max(seconds, 0.0))

    def cold_start(self, model: str, plan: str, seconds: float) -> None:
        """A request admitted with no warm worker of its model was taken after ``seconds``."""
        self.child(self.cold_start_wait, model, plan).observe(max(seconds, 0.0))

    def finished(self, model: str, lane: str, outcome: str, *, queue_ms: int | None, prompt_tokens: int,
                 completion_tokens: int, plan: str = "") -> None:
        """A request's ledger row was closed with ``outcome``."""
        self.child(self.completions, model, lane, outcome).inc()
        if queue_ms is not None:
            self.child(self.queue_wait, model, lane, plan).observe(queue_ms / 1000)
        if completion_tokens:
            self.child(self.output_tokens, model, lane).inc(completion_tokens)
        if prompt_tokens:
            self.child(self.prompt_tokens, model, lane).inc(prompt_tokens)

    def quota_rejected(self, plan: str) -> None:
        self.quota_rejections.labels(plan).inc()

    def refused(self, plan: str, status: int, code: str | None) -> None:
        label = code if code is None or _ERROR_CODE.match(code) else "other"
        self.child(self.refusals, plan, str(status), label or "").inc()

    def lost(self, reason: str, requests: int = 1) -> None:
        if requests:
            self.child(self.requests_lost, reason).inc(requests)

    def batch_line(self, model: str, answered: bool) -> None:
        self.child(self.batch_lines, model, "done" if answered else "failed").inc()


# Probes and scrapes, every few seconds from every load balancer and Prometheus: no spans of their own.
UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestObserver:
    """ASGI middleware: counts and times every HTTP request, and writes one log line for it."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, tracer: Tracer | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response: dict[str, Any] = {"status": 500, "request_id": None}
        spans = None
        if self.tracer is None or scope.get("path") in UNTRACED_PATHS:
            trace = tracecontext.continue_or_start(_header(scope, b"traceparent"))
        else:
            trace, spans = self.tracer.start(scope.get("method", ""), _header(scope, b"traceparent"), kind="server",
                                             **{"http.request.method": scope.get("method", "")})
        traceparent = (b"traceparent", trace.header().encode())
        # For a route whose work goes on after the answer (a batch's lines): request.state.traceparent.
        scope.setdefault("state", {})["traceparent"] = trace.header()

        async def observe_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        response["request_id"] = value.decode()
                message = {**message, "headers": [*message.get("headers", ()), traceparent]}
            elif response["status"] >= 400 and "code" not in response:
                response["code"] = error_code(message.get("body", b""))
            await send(message)

        self.metrics.in_progress.inc()
        with log_context(**trace.log_fields()):
            try:
                await self.app(scope, receive, observe_send)
            finally:
                self.metrics.in_progress.dec()
                matched = scope.get("route")
                route = getattr(matched, "path", None) or UNMATCHED_ROUTE
                self._record(scope, route, response, time.perf_counter() - started)
                if spans is not None:
                    spans.finish(response["status"], response.get("code"), name=f"{scope.get('method', '')} {route}",
                                 **{"http.route": route, "flatfare.request_id": response["request_id"]})

    def _record(self, scope: Scope, route: str, response: dict[str, Any], seconds: float) -> None:
        state = scope.get("state") or {}
        caller = state.get("caller")
        plan = caller.account.plan if caller is not None else ""
        observe(self.metrics, scope.get("method", ""), route, response["status"], seconds,
                request_id=response["request_id"], caller=caller, plan=plan, code=response.get("code"))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body (None: not one, or it has no code)."""
    if not body or len(body) > 65536 or body[:1] != b"{":
        return None
    try:
        error = orjson.loads(body).get("error")
    except orjson.JSONDecodeError:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def observe(metrics: GatewayMetrics, method: str, route: str, status: int, seconds: float, *,
            request_id: str | None, caller: Any, plan: str = "", model: str = "", lane: str = "",
            code: str | None = None) -> None:
    """Count and time one answered HTTP request, and write its log line."""
    metrics.child(metrics.requests, route, str(status), plan, model).inc()
    metrics.child(metrics.request_duration, route, model, lane).observe(seconds)
    if status >= 400:
        metrics.refused(plan, status, code)
    level = logging.DEBUG if route in _QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        fields = {"status": status, "duration_ms": round(seconds * 1000, 1), "route": route,
                  "request_id": request_id, "account": caller.account_name if caller else None,
                  "plan": plan, "model": model, "code": code}
        log.log(level, "%s %s %s", method, route, status, extra={k: v for k, v in fields.items() if v})


_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


def forget_dead_processes(path: str) -> None:
    """Drop the live gauges of gateway processes that died (a crashed process uvicorn replaced)."""
    for name in glob.glob(os.path.join(path, "gauge_live*.db")):
        match = _LIVE_GAUGE_FILE.search(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            multiprocess.mark_process_dead(int(match.group(1)), path)


def process_samples(metrics: GatewayMetrics) -> list[Sample]:
    """Every sample of every process of this gateway (what ``/metrics`` adds up), without the platform's."""
    multiproc_dir = os.environ.get(MULTIPROC_ENV)
    if multiproc_dir:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, multiproc_dir)
    else:
        registry = metrics.registry
    return [sample for family in registry.collect() for sample in family.samples]


def exposition(metrics: GatewayMetrics, snapshot: PlatformSnapshot) -> bytes:
    """On the event loop, the task count is the answering process's (outside one, none is reported)."""
    tasks = EventLoopTasks.of_running_loop()
    multiproc_dir = os.environ.get(MULTIPROC_ENV)
    if multiproc_dir:
        forget_dead_processes(multiproc_dir)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, multiproc_dir)
        registry.register(SnapshotCollector(snapshot))
        registry.register(tasks)
        return generate_latest(registry)
    return (generate_latest(metrics.registry) + generate_latest(_single(SnapshotCollector(snapshot)))
            + generate_latest(_single(tasks)))


def _single(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


router = APIRouter(tags=["operations"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus metrics of every process of this gateway, plus the platform's queues and outbox."""
    state = services_of(request)
    snapshot = await platform_snapshot(state)
    return Response(exposition(state.metrics, snapshot), media_type=CONTENT_TYPE_LATEST)
