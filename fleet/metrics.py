"""The fleet supervisor's Prometheus metrics: its engines by state, what it did, and its budget.

Names are a contract with docs/OPERATIONS.md's metrics table.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from flatfare.contract import WorkerState
from flatfare.fleet.decisions import Act, Budget


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.engines = Gauge("flatfare_fleet_engines", "This fleet's engines by state (starting, warm, waking, "
                             "draining, sleeping, asleep).", ["state"], registry=r)
        self.actions = Counter("flatfare_fleet_actions", "What the fleet did to its engines, by action (start, "
                               "wake, sleep, stop) and model.", ["action", "model"], registry=r)
        self.crashes = Counter("flatfare_fleet_crashes", "Engines that exited without being told to, by model.",
                               ["model"], registry=r)
        self.max_awake = Gauge("flatfare_fleet_max_awake", "Engines this fleet keeps awake at most.", registry=r)
        self.awake = Gauge("flatfare_fleet_awake", "Engines holding an accelerator now (starting, waking, warm, "
                           "draining, going to sleep).", registry=r)
        self.host_memory = Gauge("flatfare_fleet_host_memory_bytes", "Host memory for level-1 sleepers' weights: "
                                 "the budget.", registry=r)
        self.waiting = Gauge("flatfare_fleet_waiting_models", "Models with queued requests that get no engine now.",
                             registry=r)
        self.port = 0

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = server.server_port
        return self.port

    def observe(self, states: Iterable[WorkerState], budget: Budget, awake: int, waiting: int) -> None:
        counts = {state: 0 for state in WorkerState}
        for state in states:
            counts[state] += 1
        for state, count in counts.items():
            self.engines.labels(state.value).set(count)
        self.max_awake.set(budget.max_awake)
        self.awake.set(awake)
        self.host_memory.set(budget.host_memory_gb * 2**30)
        self.waiting.set(waiting)

    def acted(self, act: Act, model: str) -> None:
        self.actions.labels(act.value, model).inc()
