"""``python -m bench soak``: the verdicts can fail (a planted leak is caught), and a 30-second soak with its
restarts, batches, rotations, hang-ups and retries loses nothing and keeps the money exact.

A minute is too short to judge memory or pools that fill lazily (the hour's run, bench/results/soak.md,
judges those); what a short run can judge is checked here: every request answered or refused cleanly, the
audit exact, each retry a replay, every batch ended, no kind of Redis key without an expiry growing, and
the event-loop task counts read from both surviving processes' /metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.soak import unexpiring_growth
from bench.soak.load import Done
from bench.soak.windows import verdicts, windows

ROOT = Path(__file__).resolve().parents[2]


def _samples(rss: list[float], tasks: list[int]) -> list[dict]:
    return [{"at_s": 10.0 * i + 1, "gateway1": {"rss_mib": r, "fds": 40, "threads": 8, "tasks": t},
             "worker1": {"rss_mib": 80.0, "fds": 20, "threads": 2, "tasks": 9}, "redis_mib": 2.0, "redis_keys": 50,
             "db_connections": 4} for i, (r, t) in enumerate(zip(rss, tasks, strict=True))]


def test_a_planted_leak_is_caught_and_a_flat_run_is_not() -> None:
    done = [Done(at_s=i / 10, seconds=0.1, answered=True) for i in range(400)]
    flat = verdicts(windows(done, _samples([100, 101, 100, 101], [16, 16, 17, 16]), 10, 40), 1)
    assert all(v.ok for v in flat), flat
    grown = _samples([100, 104, 110, 118], [16, 30, 45, 60])
    leaking = {v.what: v.ok for v in verdicts(windows(done, grown, 10, 40), 1)}
    assert leaking["gateway1 RSS MiB"] is False and leaking["gateway1 asyncio tasks"] is False
    assert leaking["worker1 RSS MiB"] is True
    slower = [Done(at_s=i / 10, seconds=0.1 if i < 200 else 0.2, answered=True) for i in range(400)]
    assert {v.what: v.ok for v in verdicts(windows(slower, _samples([100] * 4, [16] * 4), 10, 40), 1)}[
        "latency p99 ms"] is False


def test_an_unexpiring_kind_of_redis_key_that_grows_is_a_leak() -> None:
    samples = [{"at_s": 0.0, "redis_kinds": {"ff:reply:*": [10, 0], "ff:pool:{m}": [1, 1]}},
               {"at_s": 30.0, "redis_kinds": {"ff:reply:*": [80, 0], "ff:pool:{m}": [1, 1], "ff:held:*": [9, 9]}}]
    assert unexpiring_growth(samples, 0.0) == {"ff:held:*": 9}  # the replies expire: bounded, not a leak


def test_a_short_soak_loses_nothing_and_keeps_the_money_exact(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "0.5", "--window-s", "10", "--warmup-windows", "1",
         "--capacity-s", "3", "--load", "0.5", "--chaos-every-s", "12", "--batch-every-s", "10", "--batch-lines", "5",
         "--rotate-every-s", "12", "--sample-s", "2", "--workdir", str(workdir), "--out", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    result_file = workdir / "soak.json"
    assert result_file.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    tally, events, audit = result["tally"], result["events"], result["audit"]
    assert tally["answered"] > 100 and tally["lost"] == 0, tally
    assert audit["clean"] and audit["charged_twice"] == 0, audit
    assert events["retried"] > 0 and events["replay_mismatch"] == 0 and events["disconnected"] > 0, events
    assert {name for _at, name in events["restarts"]} == {"gateway0", "worker0"} and events["rotations"] >= 1, events
    assert result["batches"]["submitted"] >= 1 and len(result["batches"]["ended"]) == result["batches"]["submitted"]
    assert unexpiring_growth(result["samples"], 10.0) == {}
    late = result["samples"][-1]
    assert late["gateway1"]["tasks"] and late["worker1"]["tasks"], late  # read from both processes' /metrics
    report = (tmp_path / "results" / "soak.md").read_text()
    assert "## Verdicts" in report and "Redis keys by kind" in report
    assert (tmp_path / "results" / "soak.png").stat().st_size > 10_000
