"""The alert rules and the Grafana dashboard: valid, tested with promtool where it is installed, and
naming only metrics (and labels) that the code really exports."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from flatfare.billing.checks import LedgerChecks
from flatfare.contract import Reply, ReplyKind, Usage
from flatfare.gateway.metrics import GatewayMetrics
from flatfare.gateway.platform_metrics import PlanState, PlatformSnapshot, PoolState, QueueDepth, SnapshotCollector
from tests.deploy.files import (DASHBOARD_FILES, DEPLOY, RULES_FILE, all_queries, dashboard, dashboard_queries,
                                grouping_labels, load_yaml, rules, selectors)
from flatfare.workers.metrics import WorkerMetrics
from tests.conftest import need, unavailable

# scripts/install.sh unpacks Debian's promtool into the venv; a system one works too.
PROMTOOL = next((str(p) for p in (Path(sys.executable).parent / "promtool",) if p.is_file()), None) \
    or shutil.which("promtool")
PROMTOOL_MISSING = "promtool not installed (scripts/install.sh test unpacks it; Debian: apt-get install prometheus)"
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}


def exported() -> dict[str, set[str]]:
    """Every sample name the gateway and a worker export, with its label names."""
    gateway = GatewayMetrics(CollectorRegistry())
    gateway.requests.labels("/v1/chat/completions", "200", "pro", "m").inc()
    gateway.request_duration.labels("/v1/chat/completions", "m", "standard").observe(0.1)
    gateway.in_progress.inc()
    gateway.first_token("m", "premium", "premium", 0.1)
    gateway.finished("m", "premium", "succeeded", queue_ms=5, prompt_tokens=3, completion_tokens=4, plan="premium")
    gateway.quota_rejected("free")
    gateway.refused("free", 429, "rate_limit_exceeded")
    gateway.cold_start("m", "pro", 3.0)
    gateway.lost("job_lost")
    gateway.batch_line("m", True)
    snapshot = SnapshotCollector(PlatformSnapshot(
        queues=[QueueDepth("m", "standard", 1, 1, 0.5)], demand={"m": 2}, pools={"m": PoolState(1, True, 1, 8, 2, 1)},
        billing_enabled=True, outbox_pending=1, outbox_oldest_age_s=2.0,
        plans={"premium": PlanState(5.0, 2.0, 5000, 7)}, ledger=LedgerChecks(0, 0, 0),
        up={"redis": True, "database": True}))
    platform = CollectorRegistry()
    platform.register(snapshot)
    worker = WorkerMetrics("m", CollectorRegistry())
    worker.watch(lambda: 1, 8, lambda: False)
    worker.taken("standard", int(time.time() * 1000))
    now = int(time.time() * 1000)
    worker.replied(Reply(ReplyKind.END, usage=Usage(3, 4), started_ms=now - 50, first_token_ms=now - 40))
    worker.ended_without_reply("cancelled")
    names: dict[str, set[str]] = {}
    for registry in (gateway.registry, platform, worker.registry):
        for family in registry.collect():
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    return names


def vllm_metric_names() -> set[str]:
    """The ``vllm:*`` metric names the installed vLLM registers (read from its source, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        unavailable("vLLM is not installed")
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    names = set(re.findall(r'name="(vllm:[a-z0-9_:]+)"', source))
    return names | {f"{n}_total" for n in names} | {f"{n}_{s}" for n in names for s in ("bucket", "count", "sum")}


def test_every_query_names_exported_metrics_and_labels() -> None:
    names = exported()
    vllm = vllm_metric_names()
    assert {"flatfare_requests_total", "flatfare_queue_depth", "flatfare_billing_outbox_oldest_age_seconds",
            "flatfare_worker_output_tokens_total"} <= set(names)
    for expr in all_queries():
        used = selectors(expr)
        if not used:  # Prometheus' own series of its targets
            assert expr.startswith("up{"), f"no Flatfare or vLLM metric in {expr!r}"
            continue
        labels_in_query = set(TARGET_LABELS) | {"le"}
        for name, matched in used:
            if name.startswith("vllm:"):
                assert name in vllm, f"{name} is not a metric of the installed vLLM ({expr!r})"
                continue
            assert name in names, f"{name} is not exported by gateway/metrics.py or workers/metrics.py"
            assert matched <= names[name] | TARGET_LABELS, f"{name} has no label {matched - names[name]}"
            labels_in_query |= names[name]
        if not any(n.startswith("vllm:") for n, _ in used):
            assert grouping_labels(expr) <= labels_in_query, f"grouping by an unknown label in {expr!r}"


def test_alert_rules_have_what_an_on_call_needs() -> None:
    alerts = rules()
    assert {"FlatfarePinnedModelWithoutWorker", "FlatfarePremiumQueueWaitHigh", "FlatfareHighErrorRate",
            "FlatfareBillingOutboxLag", "FlatfarePremiumTTFTAboveTarget", "FlatfareRequestsLost",
            "FlatfareLedgerMeterDisagree", "FlatfarePinnedModelNotWarm"} <= {r["alert"] for r in alerts}
    # Every alert has a promtool unit test (deploy/prometheus/tests/*.test.yml).
    tested = {case["alertname"] for path in (DEPLOY / "prometheus" / "tests").glob("*.test.yml")
              for test in load_yaml(path)["tests"] for case in test.get("alert_rule_test", [])}
    assert {r["alert"] for r in alerts if r["alert"].startswith(("FlatfarePremiumTTFT", "FlatfareRequestsLost",
                                                                   "FlatfareLedgerMeter", "FlatfarePinnedModelNot"))} <= tested
    for rule in alerts:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["for"].endswith("m")


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    need(PROMTOOL, PROMTOOL_MISSING)
    rule_tests = sorted(str(p) for p in (DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
    assert len(rule_tests) >= 2  # the platform's alerts, and each plan's promise (promises.test.yml)
    for args in (["check", "rules", str(RULES_FILE)], ["test", "rules", *rule_tests]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_prometheus_config(tmp_path: Path) -> None:
    need(PROMTOOL, PROMTOOL_MISSING)
    # The config names the rules where the compose file mounts them; point it at the repository's.
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    config = config.replace("/etc/prometheus/rules/*.yml", str(RULES_FILE.parent / "*.yml"))
    (tmp_path / "prometheus.yml").write_text(config)
    result = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 rules found" in result.stdout or "rules found" in result.stdout


def test_prometheus_config_structure() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"flatfare-gateway", "flatfare-worker"} <= jobs
    # FlatfareGatewayDown watches the job by name.
    assert any('job="flatfare-gateway"' in r["expr"] for r in rules())


# What each dashboard must show, by panel title.
TOPICS = {
    "flatfare.json": ("queue depth", "time to first token", "tokens per second", "quota rejections",
                      "billing outbox"),
    "flatfare-plans.json": ("time to first token p50 / p99 by plan, against its target", "queue wait p50 / p99 by plan",
                            "refusals per second by code", "quota used today", "cold starts", "cold start wait",
                            "batch lines done", "pinned models warm", "requests lost", "ledger and meter disagree"),
}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_is_provisioned_and_well_formed(path: Path) -> None:
    board = dashboard(path)
    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "flatfare.yml")["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert board["uid"] and board["title"]
    assert [dashboard(p)["uid"] for p in DASHBOARD_FILES].count(board["uid"]) == 1
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in TOPICS[path.name]:
        assert topic in titles
    (variable,) = board["templating"]["list"]
    assert selectors(variable["definition"])[0][0] in exported()
    assert len(dashboard_queries(path)) >= 20


def test_the_plans_dashboard_draws_each_target_beside_its_figure() -> None:
    """Each plan's latency panel shows its p50, p99 and the target the alert compares p99 with."""
    board = dashboard(DEPLOY / "grafana" / "dashboards" / "flatfare-plans.json")
    for metric, target in (("flatfare_time_to_first_token_seconds", "flatfare_plan_ttft_target_seconds"),
                           ("flatfare_queue_wait_seconds", "flatfare_plan_queue_wait_target_seconds")):
        (panel,) = [p for p in board["panels"] if p["type"] == "timeseries" and any(
            target in t["expr"] for t in p["targets"])]
        exprs = [t["expr"] for t in panel["targets"]]
        assert any("histogram_quantile(0.99" in e and f"{metric}_bucket" in e for e in exprs)
        assert any("histogram_quantile(0.5" in e and f"{metric}_bucket" in e for e in exprs)
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"
