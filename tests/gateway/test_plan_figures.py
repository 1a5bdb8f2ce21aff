"""The admin dashboard's per-plan figures, from a gateway's own samples: quantiles as Prometheus'
histogram_quantile gives them, each plan's series kept apart, refusals by code, targets beside."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from flatfare.gateway.metrics import GatewayMetrics, process_samples
from flatfare.gateway.plan_figures import plan_figures, quantile
from flatfare.gateway.platform_metrics import PlanState


def test_quantile_interpolates_in_the_bucket_like_histogram_quantile() -> None:
    # deploy/prometheus/tests/promises.test.yml: ten requests between 5 and 10 s; promtool says 9.95 s.
    assert quantile(0.99, {5.0: 0, 10.0: 10, math.inf: 10}) == 9.95
    assert quantile(0.5, {1.0: 5, 2.0: 10, math.inf: 10}) == 1.0
    assert quantile(0.5, {0.5: 0, 1.0: 4, math.inf: 4}) == 0.75
    # A rank past the last finite bound answers that bound; nothing observed answers nothing.
    assert quantile(0.99, {1.0: 1, math.inf: 10}) == 1.0
    assert quantile(0.5, {1.0: 0, math.inf: 0}) is None
    assert quantile(0.5, {}) is None


def test_each_plan_gets_its_own_figures_against_its_targets() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    for seconds in (0.04, 0.04, 0.04, 8.0):  # premium: one slow first token, over its 5 s target at p99
        metrics.first_token("m", "premium", "premium", seconds)
    metrics.first_token("m", "standard", "pro", 0.3)
    metrics.first_token("other", "standard", "pro", 0.3)
    metrics.finished("m", "premium", "succeeded", queue_ms=20, prompt_tokens=1, completion_tokens=1, plan="premium")
    metrics.cold_start("m", "pro", 12.0)
    metrics.refused("pro", 429, "rate_limit_exceeded")
    metrics.refused("pro", 429, "rate_limit_exceeded")
    metrics.refused("pro", 503, "model_cold_start_timeout")
    metrics.refused("", 401, "invalid_api_key")  # no plan: nobody's figure
    metrics.refused("pro", 400, "invalid_value")  # the client's mistake
    plans = {"premium": PlanState(5.0, 2.0, 5000, 4), "pro": PlanState(15.0, 10.0, 1000, 3),
             "free": PlanState(60.0, 30.0, 60, 0)}

    rows = {row.plan: row for row in plan_figures(process_samples(metrics), plans)}

    assert set(rows) == {"premium", "pro", "free"}
    premium, pro, free = rows["premium"], rows["pro"], rows["free"]
    assert premium.ttft.count == 4 and premium.ttft.target_s == 5.0
    assert premium.ttft.p50_s is not None and premium.ttft.p50_s <= 0.05
    assert premium.ttft.p99_s is not None and premium.ttft.p99_s > 5.0 and premium.ttft.over_target
    assert premium.queue_wait.count == 1 and not premium.queue_wait.over_target
    assert pro.ttft.count == 2 and not pro.ttft.over_target  # both models of the plan together
    assert pro.cold_starts.count == 1 and pro.cold_starts.p99_s is not None and 10 < pro.cold_starts.p99_s <= 20
    assert pro.refusals == {"rate_limit_exceeded": 2, "model_cold_start_timeout": 1, "invalid_value": 1}
    assert pro.refused == 3  # the platform's refusals, not the malformed request
    assert (pro.quota_used, pro.daily_limit) == (3, 1000)
    assert free.ttft.count == 0 and free.ttft.p99_s is None and not free.ttft.over_target
