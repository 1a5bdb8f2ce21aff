"""Many models on few engines (issue 22): cold starts, wakes and the engine budget through Flatfare's fleet.

Every mode runs Flatfare's whole path: private Redis, SQLite, ``flatfare gateway`` and one ``flatfare fleet``
whose budget is ONE awake engine, serving several on-demand catalog models. Requests go through the
``openai`` SDK, streamed, one at a time; each is labelled by what its model's engine was doing when it
was sent (no engine: ``start``; asleep: ``wake L1``/``wake L2``; ``warm``), and its time to first token
(TTFT) is measured by the client. A sampler reads the fleet's status and the workers' heartbeats every
0.25 s for the whole run: how many engines were awake (anything but asleep), per model.

* ``cpu``: three models (smollm2, gemma3-270m and a copy of smollm2) asked in turn A,B,C,A,B,C on vLLM's CPU
  engine, each a cold start (the budget stops the previous engine first), with a warm request after each;
  beside it, in the same run, a plain ``flatfare worker --model M`` start (to warm) and its first request,
  for smollm2 before the fleet and gemma after it.
* ``gpu --part levels``: two entries on one folder with real weights, host memory for one level-1 sleeper:
  full starts, level-1 and level-2 wakes, and warm requests, in turn.
* ``gpu --part many``: N entries on one 8B folder (load_format dummy, level 1): started one by one (each
  start puts the previous one to sleep), then each asked again (a wake).
* ``report``: the JSON files of ``gpu`` as bench/results/fleet_gpu.md and a plot per part (fleet_gpu_<part>.png).

The checks each run reports: no request lost (every one answered 200 and its ledger row succeeded), and the
budget never exceeded (the most awake engines any sample saw).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_py

from bench import report
from bench.fleet_report import write_gpu_report, write_outputs
from bench.fleet_stack import COLD_START_TIMEOUT_S, FLEET_STOP_TIMEOUT_S, FleetBench
from bench.procs import Service, services
from flatfare.contract import FleetStatus

RESULTS = Path(__file__).parent / "results"
SAMPLE_EVERY_S = 0.25
SMOLLM2, GEMMA, COPY = "smollm2-135m-instruct", "gemma3-270m", "smollm2-copy"
# --engine instant: the benchmark engine (no model) with a start, a sleep and a wake that take a while, so
# the machinery runs in seconds on any machine (tests/bench/test_fleet_bench.py).
INSTANT_ENV = {"FLATFARE_ENGINE": "instant", "FLATFARE_INSTANT_START_DELAY_S": "2",
               "FLATFARE_INSTANT_SLEEP_DELAY_S": "0.5", "FLATFARE_INSTANT_WAKE_DELAY_S": "0.5"}
PROMPT = "What is the capital of France?"
# Not worth starting an engine with less time left than the slowest start so far plus this.
START_MARGIN_S = 30.0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("vllm", "instant"), default="vllm",
                        help="instant: the machinery only, on the benchmark engine (no model)")
    parser.add_argument("--instant-delays", type=float, nargs=3, metavar=("START_S", "SLEEP_S", "WAKE_S"),
                        help="--engine instant: its start, sleep and wake in seconds (default: INSTANT_ENV's)")
    parser.add_argument("--max-tokens", type=int, default=16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="three models in turn on one CPU engine, vs a plain worker start (~10 min)")
    cpu.add_argument("--rounds", type=int, default=2, help="rounds of A,B,C (each request a cold start)")
    cpu.add_argument("--engine-options", default='{"enforce_eager": true}',
                     help="JSON over every catalog entry's options (FLATFARE_ENGINE_OPTIONS of the workers)")
    cpu.add_argument("--models-dir", type=Path, default=Path.home() / ".flatfare" / "models",
                     help="prepared built-in models (flatfare up's), so no run prepares them again")
    cpu.add_argument("--workdir", type=Path, default=Path("/tmp/ff-fleet-cpu"))
    cpu.add_argument("--out", type=Path, default=RESULTS / "fleet_cpu", help="path without suffix: .json .md .png")
    _common(cpu)
    gpu = sub.add_parser("gpu", help="the H200 through the fleet: start vs level-1/2 wakes; N 8B models on one GPU")
    gpu.add_argument("--part", choices=("levels", "many"), required=True)
    gpu.add_argument("--model-dir", type=Path, required=True, help="levels: real weights on disk; many: any")
    gpu.add_argument("--models", type=int, default=6, help="many: catalog entries on the folder")
    gpu.add_argument("--rounds", type=int, default=2, help="many: rounds over the models (the first starts them)")
    gpu.add_argument("--engine-options", default="{}", help="JSON over the entries' options")
    gpu.add_argument("--gpus", default="0", help="the fleet's GPU ids")
    gpu.add_argument("--end-by", type=float, default=0.0,
                     help="epoch seconds: stop before then, keep what was measured")
    gpu.add_argument("--workdir", type=Path, default=Path("/tmp/ff-fleet-gpu"))
    gpu.add_argument("--out", type=Path, required=True, help="path without suffix: .json .md (.png)")
    _common(gpu)
    rep = sub.add_parser("report", help="gpu's JSON files as bench/results/fleet_gpu.md and .png")
    rep.add_argument("paths", type=Path, nargs="+")
    rep.add_argument("--out", type=Path, default=RESULTS / "fleet_gpu")


def instant_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment for ``--engine`` (nothing for vLLM): INSTANT_ENV, with ``--instant-delays``."""
    if args.engine != "instant":
        return {}
    if not args.instant_delays:
        return dict(INSTANT_ENV)
    start, sleep, wake = args.instant_delays
    return {**INSTANT_ENV, "FLATFARE_INSTANT_START_DELAY_S": str(start), "FLATFARE_INSTANT_SLEEP_DELAY_S": str(sleep),
            "FLATFARE_INSTANT_WAKE_DELAY_S": str(wake)}


# -- what is measured --------------------------------------------------------------------------------


class Sampler:
    """Every SAMPLE_EVERY_S, what the fleet's status and the models' heartbeats say is awake."""

    def __init__(self, bench: FleetBench, models: list[str], t0: float) -> None:
        self.bench, self.models, self.t0 = bench, models, t0
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                status = self.bench.status()
                workers = self.bench.heartbeats(self.models)
            except redis_py.RedisError:
                continue
            engines = status.engines if status else {}
            self.samples.append({
                "t": round(time.monotonic() - self.t0, 2),
                "status": {e["model"] + "|" + w: e["state"] + (f" L{e['sleep_level']}" if e.get("sleep_level")
                                                               else "") for w, e in engines.items()},
                "heartbeats": {i.model + "|" + i.worker_id: i.state.value for i in workers},
                "awake_status": sum(1 for e in engines.values() if e["state"] != "asleep"),
                "awake_heartbeats": sum(1 for i in workers if i.state.value != "asleep"),
            })


def kind_of(status: FleetStatus | None, model: str) -> str:
    """What a request for ``model`` meets: its engine warm, asleep at a level, or none (a start)."""
    engines = [e for e in (status.engines.values() if status else ()) if e["model"] == model]
    if not engines:
        return "start"
    state = engines[0]["state"]
    return f"wake L{engines[0].get('sleep_level') or 1}" if state == "asleep" else state


def ask(base_url: str, key: str, model: str, max_tokens: int, t0: float) -> dict[str, Any]:
    """One streamed chat request through the SDK: TTFT and total from the client's side, the request id
    and the cold wait the gateway reports."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, timeout=COLD_START_TIMEOUT_S + 60, max_retries=0)
    sent = time.monotonic()
    # sent_ms: the wall clock the fleet's decisions carry, to place them within the request's wait.
    record: dict[str, Any] = {"model": model, "t": round(sent - t0, 2), "sent_ms": int(time.time() * 1000)}
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        record["status"] = raw.status_code
        record["request_id"] = raw.headers.get("x-request-id", "")
        wait = raw.headers.get("x-flatfare-model-wait-ms")
        record["model_wait_ms"] = int(wait) if wait is not None else None
        text = []
        for chunk in raw.parse():
            if chunk.choices and "ttft_s" not in record:
                record["ttft_s"] = round(time.monotonic() - sent, 3)
            text += [c.delta.content or "" for c in chunk.choices]
        record["text"] = "".join(text)[:80]
    except openai.APIStatusError as exc:
        record.update(status=exc.status_code, request_id=exc.response.headers.get("x-request-id", ""),
                      error=str(exc)[:300])
    except openai.APIError as exc:
        record.update(status=0, request_id="", error=f"{exc.__class__.__name__}: {exc}"[:300])
    record["total_s"] = round(time.monotonic() - sent, 3)
    client.close()
    return record


@dataclass
class Run:
    """One run's measurements, saved after every request so a deadline or a crash keeps what was done."""

    out: Path
    meta: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    plain: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".json").write_text(json.dumps(
            {"meta": self.meta, "requests": self.requests, "plain": self.plain, "checks": self.checks,
             "samples": self.samples}, indent=1))


def rotate(bench: FleetBench, run: Run, sequence: list[str], max_tokens: int, t0: float, end_by: float = 0.0) -> None:
    """Ask each model of ``sequence`` in turn, each from a settled fleet, labelled by what it met."""
    answered_ms = 0
    for model in sequence:
        status = bench.settle(answered_ms)
        kind = kind_of(status, model)
        if end_by:
            starts = [r["ttft_s"] for r in run.requests if r["kind"] == "start" and "ttft_s" in r]
            need = (max(starts, default=120.0) if kind == "start" else 10.0) + START_MARGIN_S
            if end_by - time.time() < need:
                run.meta["stopped_early"] = f"{end_by - time.time():.0f} s left before {model}'s {kind}: not sent"
                print(f"[fleet] {run.meta['stopped_early']}", flush=True)
                break
        record = {"kind": kind, **ask(bench.base_url, bench.stack.key, model, max_tokens, t0)}
        record["gpu_memory_used_mib"] = gpu_memory_used_mib()
        answered_ms = int(time.time() * 1000)
        run.requests.append(record)
        run.save()
        print(f"[fleet] {model:<24} {kind:<9} status {record['status']} TTFT {record.get('ttft_s', '-')} s "
              f"wait {record.get('model_wait_ms')} ms", flush=True)


def gpu_memory_used_mib() -> int | None:
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=False)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.strip() else None


def fleet_record(status: FleetStatus | None) -> dict[str, Any]:
    """What the fleet said last: its decisions (the report places them within each request's wait)."""
    return {"decisions": status.decisions, "host_memory_gb": status.host_memory_gb, "tick_s": status.tick_s,
            "engines": status.engines} if status else {}


def finish(bench: FleetBench, run: Run, max_awake: int = 1) -> None:
    """The run's checks: every request answered with its ledger row, the budget never exceeded."""
    ids = [r["request_id"] for r in [*run.requests, *run.plain] if r.get("request_id")]
    rows = bench.ledger(ids) if ids else {}
    for record in [*run.requests, *run.plain]:
        row = rows.get(record.get("request_id", ""))
        record["ledger"] = f"{row[0]} {row[1]}" if row else "missing"
    answered = [r for r in run.requests + run.plain if r.get("status") == 200 and r["ledger"] == "succeeded 200"]
    run.checks = {
        "requests": len(run.requests) + len(run.plain),
        "lost": len(run.requests) + len(run.plain) - len(answered),
        "max_awake": max_awake,
        "max_awake_seen_status": max((s["awake_status"] for s in run.samples), default=0),
        "max_awake_seen_heartbeats": max((s["awake_heartbeats"] for s in run.samples), default=0),
        "samples": len(run.samples),
    }
    run.save()
    print(f"[fleet] checks: {json.dumps(run.checks)}", flush=True)


# -- the modes ---------------------------------------------------------------------------------------


def plain_start(bench: FleetBench, run: Run, model: str, max_tokens: int, t0: float) -> None:
    """``flatfare worker --model M`` started by hand (no fleet running): seconds to warm, then its first request."""
    log = bench.workdir / f"plain-{model}.log"
    started = time.monotonic()
    worker = bench.group.start(Service(f"plain worker {model}", [sys.executable, "-m", "flatfare", "worker",
                                                                   "--model", model],
                                       log, env=bench.stack.env(), cwd=str(bench.workdir)))
    try:
        warm_s = worker.wait_ready(lambda: any(i.state.value == "warm" for i in bench.heartbeats([model])),
                                   COLD_START_TIMEOUT_S)
        record = {"kind": "plain start", "warm_s": round(warm_s, 2), **ask(bench.base_url, bench.stack.key, model,
                                                                           max_tokens, t0)}
    finally:
        bench.group.stop(worker)
    record["t"] = round(started - t0, 2)
    run.plain.append(record)
    run.save()
    print(f"[fleet] plain worker {model}: warm after {warm_s:.1f} s, first TTFT {record.get('ttft_s')} s", flush=True)


def run_cpu(args: argparse.Namespace) -> Run:
    options = json.loads(args.engine_options)
    models = [SMOLLM2, GEMMA, COPY]
    run = Run(args.out, {"mode": "cpu", "models": models, "engine_options": options, "max_awake": 1,
                         "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    t0 = time.monotonic()
    with services() as group:
        # 1 GiB of KV cache per engine, as flatfare up gives (vLLM's CPU default wants most of the RAM).
        bench = FleetBench(group, args.workdir, {"FLATFARE_ENGINE_OPTIONS": json.dumps(options),
                                                 "FLATFARE_MODELS_DIR": str(args.models_dir),
                                                 "VLLM_CPU_KVCACHE_SPACE": "1",
                                                 **instant_env(args)})
        try:
            bench.start()
            source, stored = bench.entry(SMOLLM2)
            bench.catalog({SMOLLM2: (source, stored), GEMMA: bench.entry(GEMMA), COPY: (source, stored)})
            plain_start(bench, run, SMOLLM2, args.max_tokens, t0)
            fleet = bench.start_fleet(models, "--gpus", "cpu")
            with Sampler(bench, models, t0) as sampler:
                run.samples = sampler.samples
                rotate(bench, run, [m for _ in range(args.rounds) for m in models for _ in range(2)],
                       args.max_tokens, t0)
            run.meta["fleet"] = fleet_record(bench.status())
            run.meta["facts"] = {m: bench.facts(m) for m in models}
            fleet.stop(FLEET_STOP_TIMEOUT_S + 30)  # gemma's start by hand, as its first start was: alone
            plain_start(bench, run, GEMMA, args.max_tokens, t0)
            finish(bench, run)
        finally:
            bench.stop()
    return run


def run_gpu(args: argparse.Namespace) -> Run:
    from flatfare.fleet.weights import weights_gb

    options = json.loads(args.engine_options)
    folder = str(args.model_dir.resolve())
    run = Run(args.out, {"mode": "gpu", "card": report.gpu_name(), "part": args.part, "model_dir": folder,
                         "engine_options": options,
                         "max_awake": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    t0 = time.monotonic()
    fleet_args = ["--gpus", args.gpus]
    if args.part == "levels":
        models = ["levels-a", "levels-b"]
        # Room for one level-1 sleeper's weights: the other sleeps at level 2.
        weights = weights_gb(folder, None, "")
        if not weights:
            raise SystemExit(f"{folder} has no weight files: level 2 reloads weights from disk "
                             "(make-model with weights)")
        fleet_args += ["--host-memory-gb", f"{1.5 * weights:.3f}"]
        run.meta["weights_gb"] = weights
        a, b = models
        sequence = [a, a, b, b, a, a, b, b, a, b]
    else:
        models = [f"many-{i + 1}" for i in range(args.models)]
        sequence = [m for m in models for _ in range(2)] + [m for _ in range(args.rounds - 1) for m in models]
    run.meta["models"] = models
    with services() as group:
        bench = FleetBench(group, args.workdir, instant_env(args))
        try:
            bench.start()
            bench.catalog({m: (folder, options) for m in models})
            bench.start_fleet(models, *fleet_args)
            with Sampler(bench, models, t0) as sampler:
                run.samples = sampler.samples
                rotate(bench, run, sequence, args.max_tokens, t0, args.end_by)
            run.meta["fleet"] = fleet_record(bench.status())
            run.meta["facts"] = {m: bench.facts(m) for m in models}
            finish(bench, run)
        finally:
            bench.stop()
    return run


def run(args: argparse.Namespace) -> int:
    if args.mode == "report":
        write_gpu_report(args.paths, args.out)
        return 0
    done = run_cpu(args) if args.mode == "cpu" else run_gpu(args)
    write_outputs(done.out, json.loads(done.out.with_suffix(".json").read_text()))
    return 0 if done.checks and not done.checks["lost"] and done.checks["max_awake_seen_status"] <= 1 \
        and done.checks["max_awake_seen_heartbeats"] <= 1 else 1
