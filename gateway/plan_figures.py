"""Each plan's promise as figures for the admin console's dashboard: the same series the Grafana plans
dashboard and the alerts read (gateway/metrics.py), computed from this gateway's own samples (every
process of it) since it started, beside each plan's targets and use today (gateway/platform_metrics.py).

Quantiles are estimated from the histograms' buckets as Prometheus' ``histogram_quantile`` does: the
bucket the rank falls in, interpolated linearly. Plain functions over samples, testable without HTTP.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.samples import Sample

from flatfare.gateway.platform_metrics import PlanState

TTFT = "flatfare_time_to_first_token_seconds_bucket"
QUEUE_WAIT = "flatfare_queue_wait_seconds_bucket"
COLD_START = "flatfare_cold_start_wait_seconds_bucket"
REFUSALS = "flatfare_refusals_total"
# Refusal codes that are the client's own doing, not a promise the platform failed to keep.
CLIENT_CODES = frozenset({"invalid_api_key", "invalid_value", "missing_required_parameter", "client_closed"})


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile of a histogram given as {upper bound: cumulative count}; None when it is empty.
    A rank in the last (+Inf) bucket answers the highest finite bound, as Prometheus does."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


@dataclass(slots=True)
class Latency:
    p50_s: float | None = None
    p99_s: float | None = None
    count: int = 0
    target_s: float | None = None

    @property
    def over_target(self) -> bool:
        return self.p99_s is not None and self.target_s is not None and self.p99_s > self.target_s


@dataclass(slots=True)
class PlanFigures:
    plan: str
    ttft: Latency
    queue_wait: Latency
    cold_starts: Latency
    refusals: dict[str, int] = field(default_factory=dict)  # by code ("" when the answer had none)
    quota_used: int = 0
    daily_limit: int | None = None

    @property
    def refused(self) -> int:
        """Refusals that are the platform's (not a bad key or a malformed request)."""
        return sum(n for code, n in self.refusals.items() if code not in CLIENT_CODES)


def _latency(buckets: dict[float, float], target_s: float | None) -> Latency:
    total = buckets.get(math.inf, 0.0)
    return Latency(quantile(0.5, buckets), quantile(0.99, buckets), int(total), target_s)


def plan_figures(samples: Iterable[Sample], plans: dict[str, PlanState]) -> list[PlanFigures]:
    """One row per plan that has a target, a row in the catalog of plans or any sample, by name."""
    histograms: dict[str, dict[str, dict[float, float]]] = {name: defaultdict(lambda: defaultdict(float))
                                                             for name in (TTFT, QUEUE_WAIT, COLD_START)}
    refusals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for sample in samples:
        plan = sample.labels.get("plan", "")
        if sample.name in histograms and plan:
            histograms[sample.name][plan][float(sample.labels["le"])] += sample.value
        elif sample.name == REFUSALS and plan:
            refusals[plan][sample.labels.get("code", "")] += int(sample.value)
    names = set(plans) | set(refusals) | {p for h in histograms.values() for p in h}
    rows = []
    for name in sorted(names):
        state = plans.get(name, PlanState())
        rows.append(PlanFigures(
            plan=name, ttft=_latency(histograms[TTFT].get(name, {}), state.ttft_target_s),
            queue_wait=_latency(histograms[QUEUE_WAIT].get(name, {}), state.queue_wait_target_s),
            cold_starts=_latency(histograms[COLD_START].get(name, {}), None),
            refusals={code: n for code, n in sorted(refusals.get(name, {}).items()) if n},
            quota_used=state.quota_used, daily_limit=state.daily_limit))
    return rows
