"""Benchmark 1: what the platform costs per request, Flatfare against LiteLLM's proxy.

Both sit in front of an engine that answers at once, so what is measured is the platform alone:
- Flatfare: the full path, ``flatfare gateway`` -> Redis -> ``flatfare worker --engine instant``;
- LiteLLM: ``litellm --config`` (master key, rate limits) -> ``bench.upstream``, an aiohttp server
  that answers with the very bytes the instant engine produces;
- direct: the load generator straight to ``bench.upstream``, the baseline the added latency is
  measured from.

The same load generator (``bench.loadgen``, its own process) drives all three, A B C A B C, in one run
on one machine. On a machine with two or more cores the proxy under test (Flatfare's gateway or
LiteLLM's proxy) gets CPU 0 to itself; everything else (worker, Redis, upstream, load generator)
shares CPU 1. CPU seconds of every process inside each measured window turn into requests/s per core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import litellm_proxy, report
from bench.procs import Service, Services, cpu_count, free_port, pinned, services
from bench.stack import FlatfareStack, http_get

MODEL = "instant"
TOKENS = 16
CHAT_PATH = "/v1/chat/completions"
FLATFARE_TARGETS = ("flatfare", "flatfare-granian", "flatfare-uvicorn", "flatfare-pg", "flatfare-traced")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=2, help="A B A B rounds; medians are quoted")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no venv install)")
    parser.add_argument("--postgres", metavar="SERVER_URL", default="",
                        help="also run Flatfare on PostgreSQL (a temporary database on this server, dropped after), "
                        "e.g. postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--servers", nargs="+", default=["uvicorn", "granian"], choices=["uvicorn", "granian"],
                        help="the gateway's HTTP servers to run: the first is target 'flatfare', others "
                        "'flatfare-<server>'")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--trace-ratio", type=float, default=0.0, metavar="RATIO",
                        help="also run target 'flatfare-traced': the first server with Flatfare's spans on at "
                        "this sampling ratio (e.g. 0.1), exported over OTLP/HTTP to a sink that drops them")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 concurrencies, 2 s")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def placement(no_pin: bool) -> tuple[str | None, str | None]:
    """(CPUs of the proxy under test, CPUs of everything else)."""
    if no_pin or cpu_count() < 2:
        return None, None
    return "0", "1"


def loadgen(url: str, key: str, concurrency: int, stream: bool, duration: float, warmup: float,
            watch: dict[str, int], cpus: str | None, seed: int = 0) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.loadgen", "--url", url, "--key", key, "--model", MODEL,
            "-c", str(concurrency), "--duration", str(duration), "--warmup", str(warmup),
            "--max-tokens", str(TOKENS), "--seed", str(seed), "--timeout", "60"]
    if stream:
        argv.append("--stream")
    for name, pid in watch.items():
        argv += ["--watch", f"{name}={pid}"]
    done = subprocess.run(pinned(argv, cpus), capture_output=True, text=True, check=False,
                          cwd=str(report.REPO_ROOT))
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_upstream(group: Services, workdir: Path, cpus: str | None) -> tuple[Service, str]:
    port = free_port()
    service = group.start(Service("upstream", pinned([sys.executable, "-m", "bench.upstream", "--port", str(port),
                                                      "--tokens", str(TOKENS)], cpus),
                                  workdir / "upstream.log", cwd=str(report.REPO_ROOT)))
    url = f"http://127.0.0.1:{port}"
    service.wait_ready(lambda: http_get(f"{url}/health")[0] == 200, 30)
    return service, url


def _summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over rounds of each (target, stream, concurrency), with CPU per request and added latency."""
    grouped: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    for p in points:
        grouped.setdefault((p["target"], p["stream"], p["concurrency"]), []).append(p)
    rows = []
    for (target, stream, conc), runs in sorted(grouped.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        def med(key: str) -> float | None:
            return report.median(r.get(key) for r in runs)

        proxy_cpu = report.median((r.get("proxy_cpu_s") or 0) / r["completed"] for r in runs if r["completed"])
        path_cpu = report.median((r.get("path_cpu_s") or 0) / r["completed"] for r in runs if r["completed"])
        client_cpu = report.median(r["client_cpu_s"] / r["completed"] for r in runs if r["completed"])
        rows.append({
            "target": target, "stream": stream, "concurrency": conc, "runs": len(runs),
            "req_per_s": med("req_per_s"), "latency_p50_ms": med("latency_p50_ms"),
            "latency_p99_ms": med("latency_p99_ms"), "ttft_p50_ms": med("ttft_p50_ms"),
            "proxy_cpu_ms_per_req": None if target == "direct" or proxy_cpu is None else proxy_cpu * 1000,
            "path_cpu_ms_per_req": None if path_cpu is None else path_cpu * 1000,
            "client_cpu_ms_per_req": None if client_cpu is None else client_cpu * 1000,
            "errors": sum(r["errors"] + r.get("unfinished", 0) for r in runs),
        })
    direct = {(r["stream"], r["concurrency"]): r for r in rows if r["target"] == "direct"}
    for row in rows:
        base = direct.get((row["stream"], row["concurrency"]))
        for q in ("p50", "p99"):
            value, ref = row[f"latency_{q}_ms"], base and base[f"latency_{q}_ms"]
            row[f"added_{q}_ms"] = None if row["target"] == "direct" or value is None or ref is None else value - ref
        cpu = row["proxy_cpu_ms_per_req"]
        row["req_per_s_per_proxy_core"] = 1000 / cpu if cpu else None
        path = row["path_cpu_ms_per_req"]
        row["req_per_s_per_path_core"] = 1000 / path if path and row["target"] != "direct" else None
    return rows


COLUMNS = ["target", "stream", "concurrency", "runs", "req_per_s", "req_per_s_per_proxy_core",
           "req_per_s_per_path_core", "latency_p50_ms", "latency_p99_ms", "added_p50_ms", "added_p99_ms",
           "ttft_p50_ms", "proxy_cpu_ms_per_req", "path_cpu_ms_per_req", "client_cpu_ms_per_req", "errors"]


def write_results(out: Path, points: list[dict[str, Any]], info: dict[str, str], settings: dict[str, Any]) -> None:
    rows = _summarize(points)
    report.write_csv(out / "overhead.csv", COLUMNS, [[r[c] for c in COLUMNS] for r in rows])
    report.write_csv(out / "overhead_runs.csv", sorted({k for p in points for k in p}),
                     [[p.get(k) for k in sorted({k for p in points for k in p})] for p in points])
    short = ["target", "stream", "concurrency", "req_per_s", "req_per_s_per_proxy_core", "req_per_s_per_path_core",
             "latency_p50_ms", "latency_p99_ms", "added_p50_ms", "added_p99_ms", "ttft_p50_ms", "proxy_cpu_ms_per_req",
             "client_cpu_ms_per_req"]
    table = report.markdown_table(short, [[r[c] for c in short] for r in rows])
    by = {(r["target"], r["stream"], r["concurrency"]): r for r in rows}
    ratio_rows = []
    for flatfare in FLATFARE_TARGETS:
        for stream in (False, True):
            for conc in settings["concurrency"]:
                f, lt = by.get((flatfare, stream, conc)), by.get(("litellm", stream, conc))
                if f and lt:
                    ratio_rows.append([flatfare, stream, conc, report.ratio(f["req_per_s"], lt["req_per_s"]),
                                       report.ratio(f["req_per_s_per_proxy_core"], lt["req_per_s_per_proxy_core"]),
                                       report.ratio(f["req_per_s_per_path_core"], lt["req_per_s_per_path_core"])])
    ratios = report.markdown_table(["flatfare", "stream", "concurrency", "req/s ratio", "per proxy core ratio",
                                    "per path core ratio"], ratio_rows) if ratio_rows else "(LiteLLM not run)"
    report.write_markdown(
        out / "overhead.md", "Overhead: Flatfare's full path against LiteLLM's proxy, instant engine",
        __doc__.split("\n\n", 1)[1] + """
Columns: `req_per_s` is wall-clock throughput; `req_per_s_per_proxy_core` is requests per CPU-second
of the proxy process alone (Flatfare's gateway; LiteLLM's proxy); `req_per_s_per_path_core` counts the
whole path's CPU (Flatfare: gateway + worker + Redis; LiteLLM: proxy + upstream). `added_*` is the
proxied latency minus the direct latency at the same concurrency (medians over rounds, in ms).
`client_cpu_ms_per_req` is the load generator's own cost; `errors` counts failed requests and requests left
unanswered when the window closed.
""", info, settings,
        [("Results (medians over rounds)", table), ("Flatfare / LiteLLM", ratios)])
    for stream in (False, True):
        tag = "stream" if stream else "nonstream"
        series_rps: dict[str, tuple[list[float], list[float]]] = {}
        series_lat: dict[str, tuple[list[float], list[float]]] = {}
        for target in (*FLATFARE_TARGETS, "litellm", "direct"):
            sel = [r for r in rows if r["target"] == target and r["stream"] == stream]
            if not sel:
                continue
            xs = [r["concurrency"] for r in sel]
            if target != "direct":
                series_rps[f"{target} per proxy core"] = (xs, [r["req_per_s_per_proxy_core"] for r in sel])
            series_rps[f"{target} wall"] = (xs, [r["req_per_s"] for r in sel])
            series_lat[f"{target} p50"] = (xs, [r["latency_p50_ms"] for r in sel])
            series_lat[f"{target} p99"] = (xs, [r["latency_p99_ms"] for r in sel])
        report.plot_lines(out / f"overhead_rps_{tag}.png", f"Requests/s ({tag}, instant engine)", "concurrency",
                          "requests/s", series_rps, logy=True)
        report.plot_lines(out / f"overhead_latency_{tag}.png", f"Latency ({tag}, instant engine)", "concurrency",
                          "ms", series_lat, logy=True)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.concurrency, args.rounds, args.duration, args.warmup = [1, 32], 1, 2.0, 0.5
    proxy_cpus, rest_cpus = placement(args.no_pin)
    load_before = report.load_average()
    report.mark_start()
    if not args.no_litellm:
        litellm_proxy.ensure_venv()
    points: list[dict[str, Any]] = []
    stacks: list[FlatfareStack] = []
    with tempfile.TemporaryDirectory(prefix="ff-bench-overhead-") as tmp, services() as group:
        workdir = Path(tmp)
        try:
            upstream, upstream_url = start_upstream(group, workdir, rest_cpus)
            targets: dict[str, tuple[str, str, dict[str, int], list[str]]] = {}
            # target -> (ledger's PostgreSQL server or "" for SQLite, HTTP server)
            variants = {("flatfare" if i == 0 else f"flatfare-{http}"): ("", http) for i, http in enumerate(args.servers)}
            if args.postgres:
                variants["flatfare-pg"] = (args.postgres, args.servers[0])
            if args.trace_ratio > 0:
                variants["flatfare-traced"] = ("", args.servers[0])
            for name, (server, http) in variants.items():
                # The traced target's spans go to the upstream's OTLP/HTTP sink; every other target's tracing is off.
                traced = ({"FLATFARE_TRACES_ENDPOINT": upstream_url, "FLATFARE_TRACES_SAMPLE_RATIO": str(args.trace_ratio)}
                          if name == "flatfare-traced" else {})
                stack = FlatfareStack(group, workdir / name, MODEL, ["--engine", "instant"],
                                      extra_env={"FLATFARE_INSTANT_TOKENS": str(TOKENS), "FLATFARE_SERVER": http,
                                                 **traced},
                                      gateway_cpus=proxy_cpus, worker_cpus=rest_cpus, redis_cpus=rest_cpus,
                                      postgres_server=server)
                stacks.append(stack)
                stack.start_storage()
                stack.start_worker(60)
                stack.start_gateway(60)
                targets[name] = (stack.base_url + CHAT_PATH, stack.key, stack.pids(), ["gateway"])
            if not args.no_litellm:
                lite = litellm_proxy.start(group, workdir, upstream_url, MODEL, proxy_cpus)
                targets["litellm"] = (f"http://127.0.0.1:{lite.port}{CHAT_PATH}",  # type: ignore[attr-defined]
                                      litellm_proxy.MASTER_KEY, {"proxy": lite.pid, "upstream": upstream.pid},
                                      ["proxy"])
            targets["direct"] = (upstream_url + CHAT_PATH, "", {"upstream": upstream.pid}, [])
            order = list(targets)
            for rnd in range(args.rounds):
                # Alternate who goes first, so drift over the run does not favour one side.
                names = order if rnd % 2 == 0 else list(reversed(order))
                for stream in (False, True):
                    for conc in args.concurrency:
                        for name in names:
                            url, key, watch, proxy_names = targets[name]
                            result = loadgen(url, key, conc, stream, args.duration, args.warmup, watch, rest_cpus,
                                             seed=rnd)
                            result.update(target=name, round=rnd)
                            result["proxy_cpu_s"] = sum(result.get(f"{p}_cpu_s", 0) for p in proxy_names)
                            result["path_cpu_s"] = sum(result.get(f"{p}_cpu_s", 0) for p in watch)
                            points.append(result)
                            print(f"[overhead] round {rnd} {name:11s} stream={stream!s:5s} c={conc:3d} "
                                  f"{result['req_per_s']:8.1f} req/s p50 {result['latency_p50_ms']} ms "
                                  f"p99 {result['latency_p99_ms']} ms errors {result['errors']} unfinished {result['unfinished']}",
                                  flush=True)
        finally:
            for stack in stacks:
                stack.stop()
    info = report.machine({"litellm": "-" if args.no_litellm else litellm_proxy.version(),
                           "wrk/loadgen": "bench.loadgen (aiohttp, one process)"})
    settings = {"concurrency": args.concurrency, "rounds": args.rounds, "measured s per point": args.duration,
                "warm-up s": args.warmup, "tokens per answer": TOKENS, "endpoint": CHAT_PATH,
                "placement": f"proxy under test on CPU {proxy_cpus}, the rest on CPU {rest_cpus}"
                if proxy_cpus else "not pinned",
                "flatfare": f"1 gateway process ({args.servers[0]}; "
                + ", ".join(f"flatfare-{h}: {h}" for h in args.servers[1:]) + "), 1 worker --engine instant, "
                "private redis-server, SQLite" + (" (flatfare-pg: the same on a temporary PostgreSQL database)"
                                                  if args.postgres else "")
                + (f" (flatfare-traced: the same with spans sampled at {args.trace_ratio:g} to an OTLP/HTTP sink)"
                   if args.trace_ratio > 0 else ""),
                "litellm": "1 proxy worker, master key, global_max_parallel_requests 10000, deployment rpm 1e7",
                "load average before / after": f"{load_before} / {report.load_average()}"}
    write_results(args.out, points, info, settings)
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    (args.out / "raw" / "overhead_points.json").write_text(json.dumps(points, indent=1))
    print(f"[overhead] wrote {args.out / 'overhead.md'}")
    return 0
