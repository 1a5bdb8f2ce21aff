"""The times that tie the processes together (flatfare.contract.timing): the shipped ones keep every
rule, each rule refuses a time that breaks it, and a gateway's settings refuse a lost-job wait a
worker's silence could outlast."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flatfare.contract import timing
from flatfare.gateway.settings import GatewaySettings

BROKEN = {
    "a worker skipping the cancel check for jobs a client may have left": {"FRESH_JOB_MS": 50},
    "a worker dead after one late heartbeat": {"WORKER_TTL_S": 1.5},
    "a fleet's status expiring between two reports": {"FLEET_TTL_S": 1},
    "a reply stream expiring between two renewals": {"REPLY_TTL_S": 5},
}


def test_the_shipped_times_keep_every_rule() -> None:
    timing.check()


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_refuses_a_time_that_breaks_it(case: str) -> None:
    changed = BROKEN[case]
    with pytest.raises(timing.TimingRuleBroken) as broken:
        timing.check(**changed)
    assert next(iter(changed)) in str(broken.value)


def test_a_gateway_waits_longer_for_a_lost_job_than_a_worker_stays_silent() -> None:
    assert timing.longest_silence_s(15) == 5 + timing.HELD_EVERY_S
    assert timing.longest_silence_s(1.5) == 1.0  # a short lease says HELD every third of it
    for lost, lease in ((15, 15), (1.5, 1.5), (2, 1.5)):  # the defaults, tests/e2e/test_quota_path, bench faults
        GatewaySettings(lost_job_after_s=lost, job_lease_s=lease)
    with pytest.raises(ValidationError, match="FLATFARE_LOST_JOB_AFTER_S"):
        GatewaySettings(lost_job_after_s=6, job_lease_s=15)
    with pytest.raises(ValidationError, match="FLATFARE_LOST_JOB_AFTER_S"):
        GatewaySettings(lost_job_after_s=15, job_lease_s=60)


def test_a_gateway_is_settled_as_dead_only_after_many_missed_beats() -> None:
    GatewaySettings(gateway_dead_after_s=3)  # bench/faults.py's
    with pytest.raises(ValidationError, match="FLATFARE_GATEWAY_DEAD_AFTER_S"):
        GatewaySettings(gateway_dead_after_s=1)
