"""The fleet's metrics: every name docs/OPERATIONS.md's "Fleet" table lists is exported, with the
engines counted by state and the budget as the fleet sees them."""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flatfare.contract import WorkerState
from flatfare.fleet.metrics import FleetMetrics
from flatfare.fleet.decisions import Act, Budget
from tests.conftest import REPO


def _documented() -> set[str]:
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    table = text[text.index("### Fleet\n"):text.index("## Alerts")]
    return set(re.findall(r"`(flatfare_fleet_\w+)`", table))


def test_the_documented_metrics_are_exported_with_what_the_fleet_saw() -> None:
    metrics = FleetMetrics()
    metrics.observe([WorkerState.WARM, WorkerState.ASLEEP, WorkerState.ASLEEP], Budget(("0", "1"), 2, 64.0, gpu=True),
                    awake=1, waiting=3)
    metrics.acted(Act.SLEEP, "m1")
    metrics.crashes.labels("m2").inc()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    names = {name for name, _ in samples}
    assert _documented() and _documented() <= names, _documented() - names
    assert samples[("flatfare_fleet_engines", (("state", "asleep"),))] == 2
    assert samples[("flatfare_fleet_engines", (("state", "starting"),))] == 0
    assert samples[("flatfare_fleet_max_awake", ())] == 2 and samples[("flatfare_fleet_awake", ())] == 1
    assert samples[("flatfare_fleet_host_memory_bytes", ())] == 64 * 2**30
    assert samples[("flatfare_fleet_actions_total", (("action", "sleep"), ("model", "m1")))] == 1
    assert samples[("flatfare_fleet_waiting_models", ())] == 3
