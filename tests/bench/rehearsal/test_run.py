"""``python -m bench rehearsal`` end to end, so the device's one-shot run does not fail on a slip: on the
instant engine with the second model, batch lines and all three phases (the machinery: accounts on every
plan through the admin API, metered prices, the fleet serving two models, the report), then shortened on
the real vLLM CPU engine (the checks: nothing lost, the money audit exact, every plan answered or refused by
its rules, the verdicts written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def rehearsal(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 900) -> dict[str, Any]:
    out = tmp_path / "flatfare.json"
    done = subprocess.run([sys.executable, "-m", "bench", "rehearsal", "run", "--out", str(out), "--workdir",
                           str(tmp_path / "w"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          check=False, env={**os.environ, **(env or {})})
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], data.get("audit"))
    return data


def report(tmp_path: Path, *paths: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "bench", "rehearsal", "report", *map(str, paths), "--out",
                           str(tmp_path / "results"), "--name", "rehearsal_test"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (tmp_path / "results" / "rehearsal_test.md").read_text()


def assert_the_checks_hold(data: dict[str, Any]) -> None:
    assert data["audit"]["faults"] == [], data["audit"]
    assert data["audit"]["billed"] > 0 and data["audit"]["stripe_events"] == data["audit"]["billed"]
    for name, phase in data["phases"].items():
        groups = phase["groups"]
        assert groups["all"]["lost"] == 0 and groups["second_model"]["lost"] == 0, name
        assert groups["all"]["answered"] > 0 and groups["premium"]["answered"] > 0, name
        assert groups["premium"]["refused_429"] == 0, (name, groups["premium"]["codes"])
        records = phase["records"]
        plans = {r["plan"] for r in records}
        assert {"free", "pro", "premium"} <= plans, plans
        # The heaviest Free account (rank 1) is held to its plan's daily quota of 60 requests.
        assert sum(1 for r in records if r["rank"] == 1 and r["status"] == 200) <= 60
    assert data["phases"]["full"]["batch"]["completed"] > 0
    if "no-heavy" in data["phases"]:
        assert not any(r["rank"] in (1, 2, 3, 4) for r in data["phases"]["no-heavy"]["records"])
    if "no-batch" in data["phases"]:
        assert not data["phases"]["no-batch"]["batch"]


def test_the_machinery_on_the_instant_engine_with_two_models(tmp_path: Path) -> None:
    # Two trace minutes in 5 s a phase: twice the compression and the peak load keep the sample (the heaviest
    # Free account still sends past its quota), at a rate the instant engine takes in its stride; 45 accounts,
    # made through the admin API for each phase, still reach the second model's (rank 40); a 1 s warm-up and
    # a short settle, where nothing measured needs a longer one.
    data = rehearsal(tmp_path, "--second-name", "rehearsal-second", "--second-source",
                     "builtin:smollm2-135m-instruct", "--window", "24", "26", "--compression", "24", "--peak-load",
                     "2.8", "--capacity", "25", "--accounts", "45", "--batch-wait-s", "10", "--phases", "full",
                     "no-heavy", "--warm-s", "1", "--idle-settle-s", "0.5",
                     env={"FLATFARE_ENGINE": "instant", "FLATFARE_INSTANT_TOKEN_DELAY_S": "0.005"})
    assert_the_checks_hold(data)
    assert data["phases"]["full"]["groups"]["second_model"]["answered"] > 0
    # The heaviest Free accounts ran out of their daily quota: refused, free, with the quota's code.
    assert data["phases"]["full"]["groups"]["plan:free"]["codes"].get("rate_limit_exceeded", 0) > 0
    assert data["meta"]["capacity"] == {"req_per_s": 25.0} and 0 < data["meta"]["window"]["sample"] <= 1
    assert data["meta"]["warm"]["answered"] == data["meta"]["warm"]["sent"] > 0
    from bench.rehearsal.results import admissible_indices

    admitted = admissible_indices(data["meta"])  # what the plans let through, rebuilt from the run's meta
    sent = {r["index"] for r in data["phases"]["full"]["records"]}
    assert admitted and admitted <= sent | {i for i in range(max(sent) + 1)}
    refused = [r for r in data["phases"]["full"]["records"] if r["index"] not in admitted and r["model"] == "main"]
    assert refused and all(r["status"] != 200 or r["rank"] in (1, 3) for r in refused)
    text = report(tmp_path, tmp_path / "flatfare.json")
    assert "| goal | measured | bound | verdict |" in text and "Per plan (phase full)" in text
    assert (tmp_path / "results" / "rehearsal_test_goodput.png").stat().st_size > 10_000


def test_shortened_on_the_cpu_engine_with_the_pace_governor(tmp_path: Path) -> None:
    # One phase: the phases' filters are tests/bench/rehearsal/test_schedule.py's; the instant run has no-heavy's.
    # Half a trace minute (6 s, 18 live requests on every plan, 4 batch lines), prompts scaled down, batch lines'
    # too: the engine's pace is known within seconds, and the lines end soon after the live requests.
    data = rehearsal(tmp_path, "--window", "26", "26.5", "--compression", "5", "--sample", "0.1", "--accounts",
                     "60", "--prompt-scale", "0.05", "--max-output", "8", "--batch-wait-s", "30", "--phases", "full",
                     "--idle-settle-s", "0.5",
                     "--main-options", '{"enforce_eager": true, "dtype": "float32", "max_model_len": 2048}',
                     # vLLM's engine gets 1 s, not 5, to end its processes at the platform's stop (then killed).
                     env={"VLLM_CPU_KVCACHE_SPACE": "1", "FLATFARE_PACE_SLACK": "1.3",
                          "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"})
    assert_the_checks_hold(data)
    # The pace governor ran on the engine's own inter-token latencies (vLLM's stat logger, EnginePace).
    paces = [s["main_governor"]["pace_ms"] for s in data["samples"] if s.get("main_governor")]
    assert any(p for p in paces), paces
    answered = [r for r in data["phases"]["full"]["records"] if r["status"] == 200]
    assert answered and all(r["completion_tokens"] == r["max_tokens"] for r in answered)  # forced lengths
    assert "Verdicts" in report(tmp_path, tmp_path / "flatfare.json")
