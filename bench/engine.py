"""Benchmark 2: Flatfare against ``vllm serve``, the same model with the same engine options.

Each round starts one system, loads it at each concurrency, stops it, then does the same with the
other (never both at once: vLLM's CPU engine busy-polls the cores), and the next round swaps the order.
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
import json
import os
import subprocess
import sys
import tempfile
import time
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
    parser.add_argument("--rounds", type=int, default=2, help="A B, B A, ... rounds; medians are quoted")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
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
    from workers.prepare import resolve_source

    settings = CommonSettings()
    return Path(resolve_source(f"builtin:{DEFAULT_NAME}", settings.models_dir, lambda m: print(f"[engine] {m}")))


def vllm_serve_argv(model_dir: Path, name: str, port: int, options: dict[str, Any]) -> list[str]:
    from workers.engine import engine_argv  # builds `vllm serve` flags from options, as the worker does

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


def run_system(system: str, args: argparse.Namespace, workdir: Path, options: dict[str, Any],
               plan: dict[int, int], rnd: int, env: dict[str, str]) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
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
                stack = FlatfareStack(group, workdir / f"flatfare_r{rnd}", args.name,
                                      ["--source", str(args.model_dir), "--engine-options", json.dumps(options)],
                                      extra_env=env, gateway_processes=args.gateway_processes)
                stack.start_storage()
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
            for conc in args.concurrency:
                # A fresh seed per (round, concurrency): no prompt repeats across runs on one server.
                seed = 1000 * rnd + conc + (0 if system == "vllm" else 500)
                result = loadgen(url, key, args.name, conc, plan[conc], args.input_len, args.output_len, seed, watch)
                result.update(system=system, round=rnd, ready_s=round(ready_s, 1))
                # Cores each server process tree kept busy during the run (vLLM's CPU engine polls: ~all).
                for proc in watch:
                    result[f"{proc}_cores"] = round(result[f"{proc}_cpu_s"] / result["elapsed_s"], 2)
                points.append(result)
                print(f"[engine] round {rnd} {system:8s} c={conc:3d} {result['req_per_s']:7.2f} req/s "
                      f"{result['output_tok_per_s']:8.1f} tok/s TTFT p50 {result['ttft_p50_ms']} ms "
                      f"ITL p50 {result['itl_p50_ms']} ms errors {result['errors']} unfinished {result['unfinished']}",
                      flush=True)
        finally:
            if stack is not None:
                stack.stop()
    return points


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in points:
        grouped.setdefault((p["system"], p["concurrency"]), []).append(p)
    rows = []
    keys = ["req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "tpot_p50_ms", "latency_p50_ms"]
    for (system, conc), runs in sorted(grouped.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row: dict[str, Any] = {"system": system, "concurrency": conc, "runs": len(runs),
                               "completed": sum(r["completed"] for r in runs),
                               "errors": sum(r["errors"] for r in runs)}
        row.update({k: report.median(r.get(k) for r in runs) for k in keys})
        rows.append(row)
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["system"], r["concurrency"]): r for r in rows}
    out = []
    for conc in sorted({r["concurrency"] for r in rows}):
        f, v = by.get(("flatfare", conc)), by.get(("vllm", conc))
        if not f or not v:
            continue

        def diff(key: str) -> float | None:
            return None if f[key] is None or v[key] is None else f[key] - v[key]

        out.append({"concurrency": conc, "tok_s_ratio": report.ratio(f["output_tok_per_s"], v["output_tok_per_s"]),
                    "req_s_ratio": report.ratio(f["req_per_s"], v["req_per_s"]),
                    "ttft_p50_diff_ms": diff("ttft_p50_ms"), "ttft_p99_diff_ms": diff("ttft_p99_ms"),
                    "itl_p50_diff_ms": diff("itl_p50_ms"), "itl_p99_diff_ms": diff("itl_p99_ms")})
    return out


ROW_COLUMNS = ["system", "concurrency", "runs", "completed", "errors", "req_per_s", "output_tok_per_s",
               "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "latency_p50_ms"]
RATIO_COLUMNS = ["concurrency", "tok_s_ratio", "req_s_ratio", "ttft_p50_diff_ms", "ttft_p99_diff_ms",
                 "itl_p50_diff_ms", "itl_p99_diff_ms"]


def write_results(out: Path, tag: str, title: str, points: list[dict[str, Any]], info: dict[str, str],
                  settings: dict[str, Any], intro: str = "") -> None:
    rows, rats = summarize(points), ratios(summarize(points))
    by_conc = {x["concurrency"]: x for x in rats}
    report.write_csv(out / f"engine_{tag}.csv", ROW_COLUMNS + ["tok_s_ratio", "req_s_ratio"],
                     [[r[c] for c in ROW_COLUMNS] + [by_conc.get(r["concurrency"], {}).get(k)
                                                    for k in ("tok_s_ratio", "req_s_ratio")] for r in rows])
    report.write_markdown(
        out / f"engine_{tag}.md", title, intro or __doc__.split("\n\n", 1)[1], info, settings,
        [("Flatfare / vLLM direct (medians over rounds)",
          report.markdown_table(RATIO_COLUMNS, [[r[c] for c in RATIO_COLUMNS] for r in rats]) if rats else "-"),
         ("Both systems (medians over rounds; ms)",
          report.markdown_table(ROW_COLUMNS, [[r[c] for c in ROW_COLUMNS] for r in rows]))])
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
    with tempfile.TemporaryDirectory(prefix="ff-bench-engine-") as tmp:
        workdir = Path(tmp)
        try:
            for rnd in range(args.rounds):
                order = args.systems if rnd % 2 == 0 else list(reversed(args.systems))
                for system in order:
                    points += run_system(system, args, workdir, options, plan, rnd, env)
                    raw.write_text(json.dumps(points, indent=1))
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
    write_results(args.out, args.tag, f"Engine ({args.tag}): Flatfare against vllm serve", points, info, settings)
    print(f"[engine] wrote {args.out / f'engine_{args.tag}.md'}")
    return 0


def engine_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    try:
        import torch
        import vllm

        versions["vllm"] = vllm.__version__
        versions["torch"] = torch.__version__
        if torch.cuda.is_available():
            versions["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return versions


def engine_settings(args: argparse.Namespace, options: dict[str, Any], plan: dict[int, int]) -> dict[str, Any]:
    return {"model": f"{args.name} ({args.model_dir})", "engine options (both)": json.dumps(options),
            "input / output tokens": f"{args.input_len} / {args.output_len} (ignore_eos, random token ids)",
            "concurrency: requests": ", ".join(f"{c}: {n}" for c, n in plan.items()), "rounds": args.rounds,
            "VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib, "client": "bench.loadgen, streaming /v1/completions",
            "order": "A B then B A: one system at a time", "gateway processes": args.gateway_processes}
