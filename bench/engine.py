"""Benchmark 2: Flatfare against ``vllm serve``, the same model with the same engine options.

Each round starts one system, loads it at each concurrency ``--repeats`` times, stops it, then does the
same with the other (never both at once: vLLM's CPU engine busy-polls the cores), and the next round swaps
the order. Repeats share one server start (an engine start costs a minute or more on the GPU), rounds
restart the servers; the tables quote medians and min-max over all runs of a point.
Both are driven by ``bench.loadgen`` on ``/v1/completions``, streaming, with prompts of exactly
``--input-len`` random token ids (fresh ones for every run, so the prefix cache never helps) and
exactly ``--output-len`` output tokens (``ignore_eos``).
- vLLM direct: ``vllm serve MODEL --served-model-name NAME <engine options>``;
- Flatfare: private Redis, SQLite, ``flatfare worker --model NAME --source MODEL --engine-options ...``
  (vLLM embedded in the worker) and ``flatfare gateway``, with an API key.

The same module runs on the GPU machine (``bench/gpu_device.sh`` calls it there with the 8B and 1B
shapes); ``python -m bench gpu report`` turns what it wrote into tables here.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.procs import Service, free_port, services
from bench.stack import FlatfareStack, http_get

DEFAULT_NAME = "smollm2-135m-instruct"
# The catalog's max_model_len for the default model; float32 rather than the catalog's bfloat16, because
# CPUs without AVX512-BF16 (these VMs: AVX2 only) emulate bf16 matmuls and prefill then takes seconds;
# enforce_eager: start-up in ~45 s instead of ~3 min. Both systems get exactly these.
DEFAULT_OPTIONS: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}
# Flatfare's worker adds this to every engine (workers/main.py); vllm serve gets it too, to stay equal.
WORKER_BASE_OPTIONS: dict[str, Any] = {"disable_log_stats": True}
SYSTEMS = ("vllm", "flatfare")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, help="model folder (default: the prepared smollm2-135m-instruct)")
    parser.add_argument("--name", default=DEFAULT_NAME, help="served model name")
    parser.add_argument("--engine-options", default=json.dumps(DEFAULT_OPTIONS),
                        help="JSON of vLLM engine options, given to both systems")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, nargs="+",
                        help="requests per concurrency (default: max(8, 2 x concurrency))")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="A B, B A, ... rounds, each a fresh server start")
    parser.add_argument("--repeats", type=int, default=1,
                        help="load runs per concurrency for each server start, fresh prompts each time")
    parser.add_argument("--py-spy", type=float, default=0, metavar="SECONDS",
                        help="after Flatfare's repeats, one more (uncounted) run at the top concurrency with py-spy "
                             "recording the worker for at most SECONDS (0: none)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--via-catalog", action="store_true",
                        help="Flatfare's worker reads the options from a catalog entry (validated as the admin API "
                             "does) instead of its --engine-options")
    parser.add_argument("--kv-cache-gib", default=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                        help="VLLM_CPU_KVCACHE_SPACE for both (CPU only)")
    parser.add_argument("--gateway-processes", type=int, default=1,
                        help="Flatfare gateway processes (vllm serve runs its one API server process)")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--tag", default="cpu", help="names the result files: engine_<tag>.md/.csv/...")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, concurrency 1 and 4, short outputs")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def requests_for(concurrency: list[int], given: list[int] | None) -> dict[int, int]:
    if given:
        if len(given) != len(concurrency):
            raise SystemExit("--requests needs one number per --concurrency")
        return dict(zip(concurrency, given, strict=True))
    return {c: max(8, 2 * c) for c in concurrency}


def default_model_dir() -> Path:
    from flatfare.settings import CommonSettings
    from flatfare.workers.prepare import resolve_source

    settings = CommonSettings()
    return Path(resolve_source(f"builtin:{DEFAULT_NAME}", settings.models_dir, lambda m: print(f"[engine] {m}")))


def vllm_serve_argv(model_dir: Path, name: str, port: int, options: dict[str, Any]) -> list[str]:
    from flatfare.workers.engine import engine_argv  # builds `vllm serve` flags from options, as the worker does

    flags = engine_argv(str(model_dir), name, {**WORKER_BASE_OPTIONS, **options})
    flags = flags[flags.index("--served-model-name"):]  # the model goes first, positionally
    return [sys.executable, "-m", "bench.vllm_serve", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), *flags]


def loadgen(url: str, key: str, name: str, concurrency: int, requests: int, input_len: int, output_len: int,
            seed: int, watch: dict[str, int] | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.loadgen", "--url", url, "--key", key, "--model", name,
            "-c", str(concurrency), "--requests", str(requests), "--stream", "--max-tokens", str(output_len),
            "--ignore-eos", "--prompt-tokens", str(input_len), "--seed", str(seed), "--timeout", "1800"]
    for proc, pid in (watch or {}).items():
        argv += ["--watch", f"{proc}={pid}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=str(report.REPO_ROOT))
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def seed_for(system: str, rnd: int, rep: int, repeats: int, conc: int) -> int:
    """A seed no other counted run uses (for concurrency < 500): a server never sees a prompt twice, so the
    prefix cache never helps a repeat."""
    return 1000 * (rnd * repeats + rep) + conc + (0 if system == "vllm" else 500)


def profile_worker(args: argparse.Namespace, stack: FlatfareStack, url: str, conc: int, requests: int,
                   rnd: int) -> None:
    """One more run at ``conc`` (not counted) with py-spy on the worker: is its Python loop the limit?

    Two samplers, both ``--nonblocking`` (the worker never pauses): all active threads of the worker and
    its children (vLLM's engine core), and the worker's GIL holder alone, whose samples over rate x seconds
    is the share of time the worker's Python ran (near 1: the loop is the bottleneck)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None or stack.worker is None:
        print("[engine] py-spy not found: no worker profile", flush=True)
        return
    rate, raw_dir = 100, args.out / "raw"
    stem = f"engine_{args.tag}_pyspy_r{rnd}"
    spies: dict[str, tuple[Path, subprocess.Popen[bytes]]] = {}
    started = time.monotonic()  # from before py-spy attaches to its SIGINT: the share is a lower bound
    for name, extra in (("worker", ["--subprocesses"]), ("worker-gil", ["--gil"])):
        path = raw_dir / f"{stem}_{name}.txt"
        spies[name] = (path, subprocess.Popen(
            [py_spy, "record", "--pid", str(stack.worker.pid), "--rate", str(rate), "--format", "raw", "--nonblocking",
             "--duration", str(max(1, int(args.py_spy))), "--output", str(path), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    result: dict[str, Any] = {}
    try:
        result = loadgen(url, stack.key, args.name, conc, requests, args.input_len, args.output_len,
                         900_000 + 1000 * rnd + conc, stack.pids())  # prompts no counted run used
    except RuntimeError as exc:  # the profile is an extra: it never costs the runs measured
        print(f"[engine] profiled run failed: {exc}", flush=True)
    finally:
        seconds = min(time.monotonic() - started, args.py_spy)
        summary: dict[str, Any] = {"concurrency": conc, "requests": requests, "seconds": round(seconds, 2),
                                   "rate": rate, "worker_pid": stack.worker.pid, "run": result}
        for spy in (spy for _, spy in spies.values() if spy.poll() is None):
            spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        for name, (path, spy) in spies.items():
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
            text = path.read_text(errors="replace") if path.exists() else ""
            summary[name] = {"samples": sum(_count(line) for line in text.splitlines()),
                             "error": (spy.stderr.read().decode(errors="replace")[-300:] if spy.stderr else "")
                             if not text else ""}
            if name == "worker":
                summary[name]["samples_by_process"] = _samples_by_process(text)
            with gzip.open(path.with_suffix(".txt.gz"), "wt") as handle:
                handle.write(text)
            path.unlink(missing_ok=True)
        gil = summary["worker-gil"]["samples"]
        summary["worker_gil_busy_share"] = round(gil / (rate * seconds), 3) if seconds > 0 else None
        (raw_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        print(f"[engine] py-spy at c={conc}: worker GIL busy {summary['worker_gil_busy_share']} of "
              f"{seconds:.1f} s, {result.get('output_tok_per_s', 0):.0f} tok/s", flush=True)


def _count(line: str) -> int:
    count = line.rpartition(" ")[2]
    return int(count) if count.isdigit() else 0


def _samples_by_process(collapsed: str) -> dict[str, int]:
    """py-spy --subprocesses names each process in the first frames; a sample belongs to the last one named."""
    found: dict[str, int] = {}
    for line in collapsed.splitlines():
        stack = line.rpartition(" ")[0]
        procs = [f for f in stack.split(";") if f.startswith("process ")]
        if procs:
            found[procs[-1][:120]] = found.get(procs[-1][:120], 0) + _count(line)
    return found


def run_system(system: str, args: argparse.Namespace, workdir: Path, options: dict[str, Any],
               plan: dict[int, int], rnd: int, env: dict[str, str],
               record: Callable[[dict[str, Any]], None]) -> None:
    """Start ``system``, run every point ``args.repeats`` times against that one start, stop it."""
    with services() as group:
        stack: FlatfareStack | None = None
        started = time.monotonic()
        try:
            if system == "vllm":
                port = free_port()
                server = group.start(Service("vllm-serve", vllm_serve_argv(args.model_dir, args.name, port, options),
                                             workdir / f"vllm_serve_r{rnd}.log", env=env, cwd=str(report.REPO_ROOT)))
                base, key = f"http://127.0.0.1:{port}", ""
                watch = {"vllm": server.pid}
                server.wait_ready(lambda: http_get(f"{base}/health")[0] == 200, args.ready_timeout)
            else:
                worker_args = [] if args.via_catalog else ["--source", str(args.model_dir), "--engine-options",
                                                           json.dumps(options)]
                stack = FlatfareStack(group, workdir / f"flatfare_r{rnd}", args.name, worker_args,
                                      extra_env=env, gateway_processes=args.gateway_processes)
                stack.start_storage()
                if args.via_catalog:
                    stack.add_catalog_entry(args.name, str(args.model_dir), options)
                stack.start_worker(args.ready_timeout)
                stack.start_gateway(args.ready_timeout)
                base, key = stack.base_url, stack.key
                watch = stack.pids()
            ready_s = time.monotonic() - started
            print(f"[engine] {system} ready in {ready_s:.0f} s", flush=True)
            url = base + "/v1/completions"
            # Warm-up (uncounted): the first requests pay for lazy initialisation on both sides.
            warm = max(args.concurrency[:2])
            loadgen(url, key, args.name, warm, warm * 2, args.input_len, min(args.output_len, 16), 99_000 + rnd)
            # Repeats outside, concurrencies inside: a drift over the minutes touches every point alike.
            for rep in range(args.repeats):
                for conc in args.concurrency:
                    seed = seed_for(system, rnd, rep, args.repeats, conc)
                    result = loadgen(url, key, args.name, conc, plan[conc], args.input_len, args.output_len, seed,
                                     watch)
                    result.update(system=system, round=rnd, repeat=rep, requests=plan[conc], seed=seed,
                                  ready_s=round(ready_s, 1), engine_options=json.dumps(options))
                    if system == "flatfare":
                        result["gateway_processes"] = args.gateway_processes
                    # Cores each server process tree kept busy during the run (vLLM's CPU engine polls: ~all).
                    for proc in watch:
                        result[f"{proc}_cores"] = round(result[f"{proc}_cpu_s"] / max(result["elapsed_s"], 1e-9), 2)
                    record(result)
                    print(f"[engine] round {rnd}.{rep} {system:8s} c={conc:3d} {result['req_per_s']:7.2f} req/s "
                          f"{result['output_tok_per_s']:8.1f} tok/s TTFT p50 {result['ttft_p50_ms']} ms ITL p50 "
                          f"{result['itl_p50_ms']} ms errors {result['errors']} unfinished {result['unfinished']}",
                          flush=True)
            if stack is not None and args.py_spy > 0:
                top = max(args.concurrency)
                profile_worker(args, stack, url, top, plan[top], rnd)
        finally:
            if stack is not None:
                stack.stop()


METRICS = ["req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "tpot_p50_ms", "latency_p50_ms"]


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, concurrency) over all its runs (rounds x repeats): each metric's median, and
    its min and max as ``<metric>_min`` / ``<metric>_max``."""
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in points:
        grouped.setdefault((p["system"], p["concurrency"]), []).append(p)
    rows = []
    for (system, conc), runs in sorted(grouped.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row: dict[str, Any] = {"system": system, "concurrency": conc, "runs": len(runs),
                               "completed": sum(r["completed"] for r in runs),
                               "errors": sum(r["errors"] for r in runs)}
        for key in METRICS:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = report.median(values)
            row[f"{key}_min"], row[f"{key}_max"] = (min(values), max(values)) if values else (None, None)
        rows.append(row)
    return rows


def spread(row: dict[str, Any], key: str) -> str:
    """``median (min-max)`` for a table cell; the median alone for a single run."""
    low, high = row.get(f"{key}_min"), row.get(f"{key}_max")
    if row.get("runs", 1) < 2 or low is None or low == high:
        return report.fmt(row[key], 2)
    return f"{report.fmt(row[key], 2)} ({report.fmt(low, 2)}-{report.fmt(high, 2)})"


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["system"], r["concurrency"]): r for r in rows}
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        f, v = by.get(("flatfare", conc)), by.get(("vllm", conc))
        if not f or not v:
            continue

        def diff(key: str, f: dict[str, Any] = f, v: dict[str, Any] = v) -> float | None:
            return None if f[key] is None or v[key] is None else f[key] - v[key]

        out.append({"concurrency": conc, "tok_s_ratio": report.ratio(f["output_tok_per_s"], v["output_tok_per_s"]),
                    # The widest the ratio can be from the runs: Flatfare's worst over vLLM's best, and back.
                    "tok_s_ratio_min": report.ratio(f["output_tok_per_s_min"], v["output_tok_per_s_max"]),
                    "tok_s_ratio_max": report.ratio(f["output_tok_per_s_max"], v["output_tok_per_s_min"]),
                    "req_s_ratio": report.ratio(f["req_per_s"], v["req_per_s"]),
                    "ttft_p50_diff_ms": diff("ttft_p50_ms"), "ttft_p99_diff_ms": diff("ttft_p99_ms"),
                    "itl_p50_diff_ms": diff("itl_p50_ms"), "itl_p99_diff_ms": diff("itl_p99_ms")})
    return out


ROW_COLUMNS = ["system", "concurrency", "runs", "completed", "errors", *METRICS]
RATIO_COLUMNS = ["concurrency", "tok_s_ratio", "tok_s_ratio_min", "tok_s_ratio_max", "req_s_ratio",
                 "ttft_p50_diff_ms", "ttft_p99_diff_ms", "itl_p50_diff_ms", "itl_p99_diff_ms"]
CSV_COLUMNS = [*ROW_COLUMNS, *(f"{k}_{end}" for k in METRICS for end in ("min", "max"))]


def write_results(out: Path, tag: str, title: str, points: list[dict[str, Any]], info: dict[str, str],
                  settings: dict[str, Any], intro: str = "",
                  sections: list[tuple[str, str]] | None = None) -> None:
    """engine_<tag>.md/.csv/.png; ``sections`` (heading, Markdown) go before the generic tables."""
    rows, rats = summarize(points), ratios(summarize(points))
    by_conc = {x["concurrency"]: x for x in rats}
    ratio_keys = ("tok_s_ratio", "tok_s_ratio_min", "tok_s_ratio_max", "req_s_ratio")
    report.write_csv(out / f"engine_{tag}.csv", CSV_COLUMNS + list(ratio_keys),
                     [[r[c] for c in CSV_COLUMNS] + [by_conc.get(r["concurrency"], {}).get(k) for k in ratio_keys]
                      for r in rows])
    cells = [[r[c] for c in ROW_COLUMNS[:5]] + [spread(r, k) for k in METRICS] for r in rows]
    report.write_markdown(
        out / f"engine_{tag}.md", title, intro or __doc__.split("\n\n", 1)[1], info, settings,
        [*(sections or []),
         ("Flatfare / vLLM direct (ratio and differences of the medians; min/max: the widest ratio the runs allow)",
          report.markdown_table(RATIO_COLUMNS, [[r[c] for c in RATIO_COLUMNS] for r in rats]) if rats else "-"),
         ("Both systems (median (min-max) over all runs; ms)", report.markdown_table(ROW_COLUMNS, cells))])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for key, label, file_key in (("output_tok_per_s", "output tokens/s", "tok"), ("ttft_p50_ms", "TTFT p50 (ms)", "ttft"),
                                 ("itl_p50_ms", "ITL p50 (ms)", "itl")):
        series = {}
        for system in SYSTEMS:
            sel = [r for r in rows if r["system"] == system]
            if sel:
                series["vLLM direct" if system == "vllm" else "Flatfare"] = ([r["concurrency"] for r in sel],
                                                                            [r[key] for r in sel])
        report.plot_lines(out / f"engine_{tag}_{file_key}.png", f"{title.split(':')[0]}: {label}", "concurrency",
                          label, series)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.concurrency, args.rounds, args.output_len = [1, 4], 1, 16
    plan = requests_for(args.concurrency, args.requests)
    load_before = report.load_average()
    report.mark_start()
    options = json.loads(args.engine_options)
    if args.model_dir is None:
        args.model_dir = default_model_dir()
    env = dict(os.environ)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    points: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "raw" / f"engine_{args.tag}_points.json"
    raw.parent.mkdir(parents=True, exist_ok=True)

    def record(point: dict[str, Any]) -> None:
        # Written after every run: a run stopped at its deadline (SIGINT) still leaves what it measured.
        points.append(point)
        raw.write_text(json.dumps(points, indent=1))

    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ff-bench-engine-") as tmp:
        workdir = Path(tmp)
        try:
            for rnd in range(args.rounds):
                order = args.systems if rnd % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    try:
                        run_system(system, args, workdir, options, plan, rnd, env, record)
                    except RuntimeError as exc:  # one system failing (see its log) still lets the other run
                        failed.append(f"{system} round {rnd}")
                        print(f"[engine] {system} failed in round {rnd}: {exc}", flush=True)
        except KeyboardInterrupt:
            print(f"[engine] interrupted: reporting the {len(points)} runs measured", flush=True)
        finally:
            logs = args.out / "raw" / f"engine_{args.tag}_logs"
            logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.rglob("*.log"):
                if log.name != "redis.log":
                    # Named by run, not by the temporary folder, so each run replaces the last one's.
                    name = log.name if log.parent == workdir else f"{log.parent.name}_{log.name}"
                    (logs / name).write_text("\n".join(
                        log.read_text(errors="replace").splitlines()[-200:]))
    info = report.machine(engine_versions())
    settings = engine_settings(args, options, plan)
    settings["load average before / after"] = f"{load_before} / {report.load_average()}"
    if failed:
        settings["failed (see raw/ logs)"] = ", ".join(failed)
    write_results(args.out, args.tag, f"Engine ({args.tag}): Flatfare against vllm serve", points, info, settings)
    print(f"[engine] wrote {args.out / f'engine_{args.tag}.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def engine_versions() -> dict[str, str]:
    """vLLM's and torch's versions from their metadata (importing vLLM takes seconds, which a run stopped at
    its deadline does not have), and the GPU's name from nvidia-smi."""
    versions: dict[str, str] = {}
    for key, dists in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",))):
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[key] = importlib.metadata.version(dist)
                break
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=False)
        if done.returncode == 0 and done.stdout.strip():
            versions["gpu"] = done.stdout.strip().splitlines()[0]
    return versions


def engine_settings(args: argparse.Namespace, options: dict[str, Any], plan: dict[int, int]) -> dict[str, Any]:
    return {"model": f"{args.name} ({args.model_dir})", "engine options (both)": json.dumps(options),
            "Flatfare's options from": "a catalog entry (--via-catalog)" if args.via_catalog
            else "the worker's --engine-options",
            "input / output tokens": f"{args.input_len} / {args.output_len} (ignore_eos, random token ids)",
            "concurrency: requests": ", ".join(f"{c}: {n}" for c, n in plan.items()), "rounds": args.rounds,
            "repeats (load runs per point per server start)": args.repeats,
            "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "client": "bench.loadgen, streaming /v1/completions",
            "order": "A B then B A: one system at a time", "gateway processes": args.gateway_processes,
            "py-spy on the worker": f"{args.py_spy:g} s, one uncounted run at the top concurrency" if args.py_spy
            else "no"}
