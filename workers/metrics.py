"""The worker's Prometheus metrics and the small HTTP server that exposes them.

A worker is one process, so its metrics live in prometheus_client's default registry, next to the
metrics vLLM registers there itself (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:generation_tokens_total``, ...); one ``/metrics`` serves both.
Metric names are a contract with deploy/prometheus and deploy/grafana (tests/deploy checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from flatfare.contract import Reply, ReplyKind
from flatfare.loop_tasks import EventLoopTasks

QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def reply_outcome(reply: Reply) -> str:
    """How a job ended, from its terminal reply: succeeded, rejected (the engine refused the request,
    4xx) or failed (5xx)."""
    if reply.kind is ReplyKind.ERROR or reply.status >= 400:
        return "rejected" if reply.status < 500 else "failed"
    return "succeeded"


class WorkerMetrics:
    """Every metric of one worker process, for the one model it serves."""

    def __init__(self, model: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.model = model
        self.registry = registry
        r = registry
        self.jobs = Counter("flatfare_worker_jobs", "Jobs this worker finished, by outcome (succeeded, rejected, "
                            "failed, cancelled, skipped).", ["model", "outcome"], registry=r)
        self.queue_wait = Histogram("flatfare_worker_queue_wait_seconds", "Job queued by the gateway to taken "
                                    "by this worker.", ["model", "lane"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "flatfare_worker_time_to_first_token_seconds", "Job taken to the engine's first output (queue "
            "wait excluded).", ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.job_duration = Histogram("flatfare_worker_job_duration_seconds", "Job taken to its last reply.",
                                      ["model"], buckets=DURATION_BUCKETS, registry=r)
        self.output_tokens = Counter("flatfare_worker_output_tokens", "Output tokens generated; rate() gives "
                                     "tokens per second.", ["model"], registry=r)
        self.prompt_tokens = Counter("flatfare_worker_prompt_tokens", "Prompt tokens processed.", ["model"],
                                     registry=r)
        self.inflight = Gauge("flatfare_worker_inflight_jobs", "Jobs this worker holds now.", ["model"], registry=r)
        self.capacity = Gauge("flatfare_worker_capacity", "Jobs this worker holds at most.", ["model"], registry=r)
        self.draining = Gauge("flatfare_worker_draining", "1 while the worker finishes its jobs before exiting.",
                              ["model"], registry=r)
        self._server: Any = None
        self._tasks: EventLoopTasks | None = None

    def watch(self, inflight: Callable[[], int], capacity: int, draining: Callable[[], bool]) -> None:
        """Read the worker loop's state at each scrape."""
        self.inflight.labels(self.model).set_function(lambda: float(inflight()))
        self.capacity.labels(self.model).set(capacity)
        self.draining.labels(self.model).set_function(lambda: float(draining()))

    def taken(self, lane: str, enqueued_ms: int) -> None:
        self.queue_wait.labels(self.model, lane).observe(max(time.time() - enqueued_ms / 1000, 0.0))

    def replied(self, reply: Reply) -> None:
        """A job's terminal reply was written."""
        self.jobs.labels(self.model, reply_outcome(reply)).inc()
        if reply.started_ms:
            self.job_duration.labels(self.model).observe(max(time.time() - reply.started_ms / 1000, 0.0))
            if reply.first_token_ms:
                self.time_to_first_token.labels(self.model).observe(
                    max(reply.first_token_ms - reply.started_ms, 0) / 1000)
        if reply.usage is not None:
            if reply.usage.completion_tokens:
                self.output_tokens.labels(self.model).inc(reply.usage.completion_tokens)
            if reply.usage.prompt_tokens:
                self.prompt_tokens.labels(self.model).inc(reply.usage.prompt_tokens)

    def ended_without_reply(self, outcome: str) -> None:
        """A job ended with no reply: ``cancelled`` (its client left) or ``skipped`` (left before it started)."""
        self.jobs.labels(self.model, outcome).inc()

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) in a thread; returns the port. Called on
        the worker's event loop, whose tasks it reports too."""
        if self._tasks is None:
            self._tasks = EventLoopTasks.of_running_loop()
            self.registry.register(self._tasks)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._tasks is not None:
            self.registry.unregister(self._tasks)
            self._tasks = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
