"""The times that tie the processes together, and the rules between them, checked in code.

Each process keeps its own clock of these (a worker heartbeats, a gateway watches its client, a fleet
reports its status), and the other side relies on the pace: a rule broken here breaks nothing at
once, only the day a job is cancelled a millisecond after it was claimed, or Redis loses its data.
So every rule is a :data:`RULES` row, checked when this module is imported (:func:`check`: a broken
constant stops every process at start, and the tests), and the one a setting must keep,
``FLATFARE_LOST_JOB_AFTER_S`` against the workers' lease, by the gateway's settings
(:func:`check_lost_job_after`). Imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A worker's heartbeat (its WorkerInfo in worker_key and its score in pool_key): every second.
HEARTBEAT_INTERVAL_S = 1.0
# A worker is live while its heartbeat is younger than this.
WORKER_TTL_S = 5.0
# A claimed job whose worker has not renewed it for this long is taken over by another worker; the
# worker renews every third of it.
DEFAULT_LEASE_S = 15.0
# How often a worker running jobs whose queue entries were lost (Redis lost its data) says so.
HELD_EVERY_S = 2.0
# A reply stream outlives its request by this much, so a gateway that died mid-read leaves no garbage;
# the gateway renews its own stream's TTL every REPLY_RENEW_EVERY_S while it lives.
REPLY_TTL_S = 600
REPLY_RENEW_EVERY_S = 5.0
CANCEL_TTL_S = 600
# A gateway process renews its sign of life (and flushes its released units) this often; another one
# settles it once it has been silent for its settings' gateway_dead_after_s.
GATEWAY_BEAT_S = 0.5
# A fleet supervisor reports its status every FLEET_STATUS_EVERY_S; the status expires on its own
# FLEET_TTL_S after the last.
FLEET_STATUS_EVERY_S = 1.0
FLEET_TTL_S = 10
# A gateway starts watching for its client leaving only once a request has waited this long for its
# first reply (a task per request costs more than a fast model's whole answer)...
WATCH_AFTER_S = 0.05
# ... so a job claimed this soon after it was queued cannot have been cancelled yet: a worker skips
# the cancellation check for it, a round trip on the path of every fast request.
FRESH_JOB_MS = 20


class TimingRuleBroken(ValueError):
    """Two processes' times no longer fit together; the message names the rule and what to change."""


@dataclass(frozen=True, slots=True)
class Rule:
    holds: Callable[[dict[str, Any]], bool]
    says: str


RULES = (
    Rule(lambda t: t["FRESH_JOB_MS"] < t["WATCH_AFTER_S"] * 1000,
         "FRESH_JOB_MS must stay below WATCH_AFTER_S: a worker skips the cancellation check only for jobs "
         "no client can have left yet"),
    Rule(lambda t: t["WORKER_TTL_S"] >= 2 * t["HEARTBEAT_INTERVAL_S"],
         "WORKER_TTL_S must cover two heartbeats (HEARTBEAT_INTERVAL_S): one late beat must not make a "
         "live worker look dead"),
    Rule(lambda t: t["FLEET_TTL_S"] >= 2 * t["FLEET_STATUS_EVERY_S"],
         "FLEET_TTL_S must cover two status reports (FLEET_STATUS_EVERY_S): a live fleet's status must "
         "not expire between them"),
    Rule(lambda t: t["REPLY_TTL_S"] >= 2 * t["REPLY_RENEW_EVERY_S"],
         "REPLY_TTL_S must cover two renewals (REPLY_RENEW_EVERY_S): a live gateway's reply stream must "
         "not expire between them"),
)


def check(**changed: float) -> None:
    """Raise :class:`TimingRuleBroken` naming each rule the times break; ``changed``: times other than
    this module's (what a change would make them)."""
    times = {name: value for name, value in globals().items() if name.isupper() and isinstance(value, (int, float))}
    unknown = set(changed) - set(times)
    if unknown:
        raise KeyError(f"no such time: {', '.join(sorted(unknown))}")
    times.update(changed)
    broken = [rule.says for rule in RULES if not rule.holds(times)]
    if broken:
        raise TimingRuleBroken("; ".join(broken) + ".")


def longest_silence_s(lease_s: float) -> float:
    """The longest a live worker goes without a word about a job whose queue entry Redis lost: its
    lease renewal (every third of the lease) finds the entry gone, then it says HELD every
    HELD_EVERY_S, or every third of its lease if that is shorter (workers/loop.py)."""
    return lease_s / 3 + min(lease_s / 3, HELD_EVERY_S)


def check_lost_job_after(lost_job_after_s: float, lease_s: float) -> None:
    """A gateway answers a job lost with Redis's data after ``lost_job_after_s`` of silence: longer than
    the workers' longest silence about a job they still run, or a running job is answered lost."""
    if lost_job_after_s <= longest_silence_s(lease_s):
        raise TimingRuleBroken(
            f"lost_job_after_s ({lost_job_after_s:g} s) must exceed what a worker with a {lease_s:g} s job lease "
            f"may stay silent about a job it runs ({longest_silence_s(lease_s):g} s: a third of the lease, then "
            f"its HELD replies every {HELD_EVERY_S:g} s at most): raise FLATFARE_LOST_JOB_AFTER_S or lower "
            "FLATFARE_JOB_LEASE_S.")


def check_dead_after(gateway_dead_after_s: float) -> None:
    """Another gateway settles one silent for ``gateway_dead_after_s``: many of its beats must be missed first."""
    if gateway_dead_after_s < 4 * GATEWAY_BEAT_S:
        raise TimingRuleBroken(
            f"gateway_dead_after_s ({gateway_dead_after_s:g} s) must cover at least four of a gateway's "
            f"{GATEWAY_BEAT_S:g} s beats, or a live but busy gateway is settled as dead: raise "
            "FLATFARE_GATEWAY_DEAD_AFTER_S.")


check()
