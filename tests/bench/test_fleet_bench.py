"""``python -m bench fleet``'s machinery on the instant engine (a start, a sleep and a wake that take a
while), so the real runs (the CPU engine here, the H200's one-shot device call) do not fail on a slip: the
whole stack and fleet come up, every request is labelled by what its engine was doing, answered and found
in the ledger, the budget sampler sees one awake engine at most, the GPU parts alternate level-1 and
level-2 wakes, a deadline stops a run early with what it measured kept, and the reports are written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_PLOTS = importlib.util.find_spec("matplotlib") is not None
RUN_TIMEOUT_S = 600
# The instant engine's start, sleep and wake (s): long enough to be caught taking a while, shorter than the
# bench's own (2, 0.5, 0.5), which a run of a dozen of them waited out for nothing the checks read.
INSTANT_DELAYS = ("--instant-delays", "0.5", "0.2", "0.2")


def bench(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "bench", "fleet", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False, env={**os.environ, **(env or {})})
    return done.returncode, done.stdout + done.stderr


def results(out: Path) -> dict[str, Any]:
    return json.loads(out.with_suffix(".json").read_text())


def kinds(data: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["model"], r["kind"]) for r in data["requests"]]


def assert_nothing_lost(data: dict[str, Any]) -> None:
    for record in data["requests"] + data["plain"]:
        assert record["status"] == 200 and record["ledger"] == "succeeded 200", record
        assert record["ttft_s"] > 0 and record["text"], record
    checks = data["checks"]
    assert checks["lost"] == 0 and checks["requests"] == len(data["requests"]) + len(data["plain"])
    # The sampler ran the whole time and saw the one engine: at most one, and at some point one.
    assert checks["max_awake_seen_status"] == checks["max_awake_seen_heartbeats"] == 1, checks
    assert checks["samples"] >= 10


def assert_reports(out: Path, *titles: str) -> None:
    text = out.with_suffix(".md").read_text()
    for title in titles:
        assert title in text, text[:2000]
    if HAS_PLOTS:
        assert out.with_suffix(".png").stat().st_size > 10_000


def test_cpu_mode_rotates_three_models_through_one_engine_beside_plain_starts(tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    # The fleet decides every 0.1 s, as on a GPU host, not every 0.5 s: six starts and stops in turn, each a few
    # of its ticks, with no engine here that takes seconds to start anyway.
    code, log = bench(tmp_path, "cpu", "--engine", "instant", *INSTANT_DELAYS, "--rounds", "1", "--workdir",
                      str(tmp_path / "w"), "--out", str(out), env={"FLATFARE_FLEET_TICK_S": "0.1"})
    assert code == 0, log[-4000:]
    data = results(out)
    models = ["smollm2-135m-instruct", "gemma3-270m", "smollm2-copy"]
    # Each model's first request meets no engine (the budget stopped the previous one), its second a warm one.
    assert kinds(data) == [(m, k) for m in models for k in ("start", "warm")]
    for record in data["requests"]:
        # The gateway says how long a cold request waited for its engine, and only on a cold one.
        assert (record["model_wait_ms"] is not None) == (record["kind"] == "start"), record
    assert [(p["model"], p["kind"]) for p in data["plain"]] == [(models[0], "plain start"), (models[1], "plain start")]
    assert all(p["warm_s"] > 0 for p in data["plain"])
    assert_nothing_lost(data)
    # The catalog held the three as the fleet's only models, on demand.
    assert {d["model"] for d in data["meta"]["fleet"]["decisions"] if d["action"] == "start"} == set(models)
    assert_reports(out, "| smollm2-copy |", "lost: **0**", "| 1 |")


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A model folder whose weights weigh 1 GiB (a sparse file: the fleet sizes a sleeper by the files)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with (folder / "model.safetensors").open("wb") as f:
        f.truncate(2**30)
    return folder


def gpu(tmp_path: Path, part: str, model_dir: Path, *args: str) -> tuple[int, str, Path]:
    out = tmp_path / part
    # The options the device run gives (validated like the admin API's): the instant engine ignores them.
    code, log = bench(tmp_path, "gpu", "--engine", "instant", *INSTANT_DELAYS, "--part", part, "--model-dir",
                      str(model_dir), "--engine-options", '{"load_format": "dummy", "enforce_eager": true, '
                      '"gpu_memory_utilization": 0.8}', "--workdir", str(tmp_path / f"w-{part}"), "--out", str(out),
                      *args)
    return code, log, out


def test_gpu_levels_part_alternates_level_one_and_level_two_wakes(tmp_path: Path, weights: Path) -> None:
    code, log, out = gpu(tmp_path, "levels", weights, "--end-by", str(time.time() + RUN_TIMEOUT_S))
    assert code == 0, log[-4000:]
    data = results(out)
    a, b = "levels-a", "levels-b"
    # Host memory for one level-1 sleeper: whichever sleeps beside it drops its weights (level 2).
    assert kinds(data) == [(a, "start"), (a, "warm"), (b, "start"), (b, "warm"), (a, "wake L1"), (a, "warm"),
                           (b, "wake L2"), (b, "warm"), (a, "wake L1"), (b, "wake L2")]
    assert data["meta"]["weights_gb"] == 1.0
    assert_nothing_lost(data)
    # The fleet's own record agrees: it put engines to sleep at both levels.
    actions = {d["action"] for d in data["meta"]["fleet"]["decisions"]}
    assert {"sleep (level 1)", "sleep (level 2)", "wake"} <= actions
    assert_reports(out, "full start vs level-1 and level-2 wakes", "| wake L2 | 2 |")


def test_gpu_many_part_starts_each_model_then_wakes_it_and_the_report_reads_both_parts(tmp_path: Path) -> None:
    folder = tmp_path / "nothing"  # load_format dummy: no weights on disk, every sleeper at level 1
    folder.mkdir()
    code, log, out = gpu(tmp_path, "many", folder, "--models", "3", "--rounds", "2")
    assert code == 0, log[-4000:]
    data = results(out)
    models = ["many-1", "many-2", "many-3"]
    assert kinds(data) == [(m, k) for m in models for k in ("start", "warm")] + [(m, "wake L1") for m in models]
    assert_nothing_lost(data)
    assert_reports(out, "3 models on one GPU", "Goal (an asleep model answers within 1.5 s")
    # The report here, from the device's JSON files (a folder of them, as its tarball unpacks).
    done = subprocess.run([sys.executable, "-m", "bench", "fleet", "report", str(tmp_path), "--out",
                           str(tmp_path / "report" / "fleet_gpu")], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    report = (tmp_path / "report" / "fleet_gpu.md").read_text()
    assert "## 3 models on one GPU" in report and "| many-3 | wake L1 |" in report
    if HAS_PLOTS:
        assert (tmp_path / "report" / "fleet_gpu_many.png").stat().st_size > 10_000


def test_a_deadline_stops_the_run_before_a_start_it_cannot_finish_and_keeps_the_results(tmp_path: Path) -> None:
    folder = tmp_path / "nothing"
    folder.mkdir()
    # Too little time for a start (none measured yet: assumed to take 120 s): nothing is sent.
    code, log, out = gpu(tmp_path, "many", folder, "--models", "2", "--end-by", str(time.time() + 100))
    assert code == 0, log[-4000:]
    data = results(out)
    assert data["requests"] == [] and "not sent" in data["meta"]["stopped_early"]
    assert_reports(out, "Stopped early:")
