"""The fault benchmark's scenarios with fewer repetitions: processes killed and services stopped
under load, each on a platform of its own (real Redis, SQLite or PostgreSQL, workers, gateways and
Stripe's edge). Whatever the fault: no request lost, none billed twice in the ledger, no meter event
sent twice to Stripe, and once the platform settles, Stripe kept exactly the billable requests, the
quota units counted in Redis equal the billable ledger rows, the outbox rows and the meter events
Stripe kept, with no row left open."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faults import SCENARIOS, Row, run_scenario
from tests.conftest import unavailable

pytestmark = pytest.mark.faults

# Clean errors each fault may cause; anything else is a failure of the test.
ALLOWED = {
    "worker_kill": {"worker_lost"},
    "sigterm_drain": set(),
    "gateway_kill": set(),
    "redis_restart": {"503 queue_unavailable", "503 quota_unavailable"},
    "redis_loss": {"429 rate_limit_exceeded", "404 model_not_found", "503 model_unavailable", "503 queue_unavailable",
                   "503 quota_unavailable", "503 job_lost", "job_lost"},
    "postgres_stop": {"503 database_unavailable", "503 ledger_unavailable"},
    "stripe_failing": set(),
    "day_boundary": set(),
}


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.test_reps], ids=lambda s: s.name)
def test_no_request_is_lost_or_charged_twice(scenario, tmp_path: Path) -> None:
    row: Row = run_scenario(scenario, tmp_path, scenario.test_reps, quick=True)
    if row.audit is None:
        unavailable(row.note)
    tally, audit = row.tally, row.audit
    assert tally.lost == 0, tally.lost_examples
    # The money (bench/audit.py; tests/faults/test_audit.py shows each number reports its fault):
    assert audit.billed_twice == []  # no request id with two billable ledger rows
    assert audit.sent_twice == {}  # no meter event sent again under another key (Stripe records every call)
    assert (audit.stripe_missing, audit.stripe_extra) == ([], [])  # Stripe kept exactly the billable requests
    assert audit.unaccounted == {}  # units counted = billable rows + units given back, per account and day
    assert audit.open_rows == 0
    assert audit.counted_by_day == audit.billable_by_day  # per quota day
    assert audit.billable == audit.outbox == audit.outbox_sent == audit.stripe_events
    assert set(tally.failed) <= ALLOWED[scenario.name], tally.failed
    assert tally.answered > 0
    if scenario.name == "gateway_kill":  # what the killed gateway had in flight was settled free
        assert audit.billable == tally.answered
    if scenario.name == "redis_loss":
        assert audit.billable <= 200  # the day's limit, across the loss
        assert tally.failed["503 job_lost"] > 0  # jobs were queued at the loss, and were answered
    if scenario.name == "stripe_failing":
        assert audit.stripe_calls > audit.stripe_events  # failures were retried
    if scenario.name == "day_boundary":
        assert len(audit.billable_by_day) == 2  # both days saw requests, each counted on its own
        # ... on the right day: requests sent while every clock stood before midnight are billed on the
        # day before, those sent once every clock had passed it on the day after, each by its id.
        assert set(tally.known_days.values()) == set(audit.billable_by_day), row.note
        assert row.misdated == [], row.misdated[:5]
