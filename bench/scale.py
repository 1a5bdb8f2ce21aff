"""Benchmark: requests/s against the number of worker hosts (1, 2, 4), Flatfare spread over hosts.

Every part runs on a host of its own, made of network namespaces on one machine (bench.hosts,
bench.cluster): Redis and PostgreSQL on the storage host, one gateway process on the gateway host,
each worker on its own host, and the load generator (``bench.loadgen``, a closed loop of clients
sending non-streaming chat completions) on the client host. All traffic crosses a bridge between
the hosts; none of it touches the root namespace.

The workers run the instant engine made capacity-bound, the way a GPU is: each holds ``capacity``
requests at once and answers each after ``delay`` seconds, so one worker serves at most
``capacity / delay`` requests a second. What is measured is whether the platform's shared parts
(gateway, Redis, the ledger on PostgreSQL) let throughput grow with the workers, up to that bound.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench import hosts, report
from bench.cluster import Cluster, InstantWorker, loadgen_result
from bench.postgres import postgres_unavailable
from bench.procs import services


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker host counts to measure")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the counts, alternating their order")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64, help="clients: above the largest total capacity")
    parser.add_argument("--capacity", type=int, default=8, help="requests each worker holds at once")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds each request takes on a worker")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 3 s points")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def _use_workers(cluster: Cluster, count: int) -> None:
    """Exactly the first ``count`` worker hosts running a worker."""
    for index, name in enumerate(cluster.worker_hosts):
        running = name in cluster.workers
        if index < count and not running:
            cluster.start_worker(name)
        elif index >= count and running:
            cluster.stop_worker(name)


def _measure(cluster: Cluster, args: argparse.Namespace, count: int, rnd: int) -> dict[str, Any]:
    assert cluster.gateway is not None
    watch = ["--watch", f"gateway={cluster.gateway.pid}"]
    if cluster.redis is not None:
        watch += ["--watch", f"redis={cluster.redis.pid}"]
    for name, service in cluster.workers.items():
        watch += ["--watch", f"{name}={service.pid}"]
    load = cluster.loadgen("-c", str(args.concurrency), "--duration", str(args.duration), "--warmup",
                           str(args.warmup), "--seed", str(rnd), *watch, timeout_s=60)
    result = loadgen_result(load, timeout_s=args.duration + args.warmup + 120)
    result.update(workers=count, round=rnd,
                  workers_cpu_s=sum(result.pop(f"{name}_cpu_s", 0) for name in cluster.workers))
    return result


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    return report.median(run.get(key) for run in runs)


def _summarize(points: list[dict[str, Any]], engine: InstantWorker) -> list[dict[str, Any]]:
    rows = []
    for count in sorted({p["workers"] for p in points}):
        runs = [p for p in points if p["workers"] == count]
        bound = count * engine.capacity / engine.delay_s
        rps = _median(runs, "req_per_s")
        rows.append({
            "worker_hosts": count, "runs": len(runs), "req_per_s": rps, "capacity_bound_req_per_s": bound,
            "of_bound": report.ratio(rps, bound),
            # How long each request held a worker's slot: the engine's delay plus the worker's own
            # time per job (reply, acknowledgement, next claim).
            "slot_ms_per_req": 1000 * count * engine.capacity / rps if rps else None,
            "latency_p50_ms": _median(runs, "latency_p50_ms"),
            "latency_p99_ms": _median(runs, "latency_p99_ms"),
            "gateway_cores": report.median(r["gateway_cpu_s"] / r["elapsed_s"] for r in runs),
            "gateway_cpu_ms_per_req": report.median(1000 * r["gateway_cpu_s"] / r["completed"]
                                                    for r in runs if r["completed"]),
            "redis_cores": report.median(r.get("redis_cpu_s", 0) / r["elapsed_s"] for r in runs),
            "workers_cores": report.median(r["workers_cpu_s"] / r["elapsed_s"] for r in runs),
            "errors": sum(r["errors"] + r["unfinished"] for r in runs),
        })
    first = rows[0]["req_per_s"] if rows else None
    for row in rows:
        row["speedup"] = report.ratio(row["req_per_s"], first)
    return rows


def _bounds(rows: list[dict[str, Any]], engine: InstantWorker) -> str:
    """What the figures say limits throughput, in words, with the figures of the largest count."""
    if not rows:
        return "(no points)"
    top = rows[-1]
    shares = " / ".join(report.fmt(r["of_bound"], 2) for r in rows)
    return f"""
The workers' capacity: throughput reaches {shares} of workers x capacity / delay at
{" / ".join(str(r["worker_hosts"]) for r in rows)} worker hosts. Each request held a worker's slot
{report.fmt(top["slot_ms_per_req"], 1)} ms at {top["worker_hosts"]} hosts against the engine's
{engine.delay_s * 1000:.0f} ms; the rest is spent outside the engine (the worker writing the reply,
acknowledging, claiming the next) on cores that every host shares. The gateway process used
{report.fmt(top["gateway_cores"], 2)} of a core at {top["worker_hosts"]} hosts
({report.fmt(top["gateway_cpu_ms_per_req"], 2)} ms of CPU a request), far from what one gateway core
serves (`overhead.md`), so the shared parts were not the limit at these rates.

What this does not show: the hosts share one kernel and one machine's cores, and the bridge adds no
latency, loss or bandwidth limit of a real network. A worker host cut off from the bridge is tested,
not benchmarked: `tests/e2e/test_multihost.py`.
"""


COLUMNS = ["worker_hosts", "runs", "req_per_s", "speedup", "capacity_bound_req_per_s", "of_bound", "slot_ms_per_req",
           "latency_p50_ms",
           "latency_p99_ms", "gateway_cores", "gateway_cpu_ms_per_req", "redis_cores", "workers_cores", "errors"]


def write_results(out: Path, points: list[dict[str, Any]], engine: InstantWorker, info: dict[str, str],
                  settings: dict[str, Any]) -> None:
    rows = _summarize(points, engine)
    report.write_csv(out / "scale.csv", COLUMNS, [[r[c] for c in COLUMNS] for r in rows])
    table = report.markdown_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows])
    report.write_markdown(out / "scale.md", "Scale: requests/s against worker hosts, one machine as many hosts",
                          __doc__.split("\n\n", 1)[1] + """
Columns: `req_per_s` is the median over rounds of wall-clock throughput; `speedup` is against one
worker host; `capacity_bound_req_per_s` is workers x capacity / delay, the most the workers can
serve, and `of_bound` the share of it reached; `slot_ms_per_req` (workers x capacity / req_per_s) is
how long each request held a worker's slot: the engine's delay plus the worker's own time per job.
`*_cores` are CPU-seconds per second of the gateway process, Redis and all workers together inside
the measured window (the machine has the cores listed below, shared by every host); `errors` counts
failed requests and requests left unanswered when a window closed.
""", info, settings, [("Results (medians over rounds)", table), ("What bounds it", _bounds(rows, engine))])
    xs = [r["worker_hosts"] for r in rows]
    report.plot_lines(out / "scale.png", "Requests/s against worker hosts (instant engine, capacity-bound)",
                      "worker hosts", "requests/s", {"measured": (xs, [r["req_per_s"] for r in rows]),
                                                     "capacity bound": (xs, [r["capacity_bound_req_per_s"]
                                                                            for r in rows])})


def run(args: argparse.Namespace) -> int:
    reason = hosts.unavailable() or postgres_unavailable()
    if reason:
        print(f"[scale] cannot run here: {reason}")
        return 2
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 3.0, 1.0
    engine = InstantWorker(capacity=args.capacity, delay_s=args.delay)
    load_before = report.load_average()
    report.mark_start()
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ff-bench-scale-") as tmp, hosts.Network() as network, \
            services() as group:
        cluster = Cluster(network, group, Path(tmp), engine)
        try:
            cluster.start()
            for _ in range(max(args.workers)):
                cluster.add_worker_host()
            for rnd in range(args.rounds):
                # Alternate the order, so drift over the run does not favour one count.
                for count in (args.workers if rnd % 2 == 0 else list(reversed(args.workers))):
                    _use_workers(cluster, count)
                    result = _measure(cluster, args, count, rnd)
                    points.append(result)
                    print(f"[scale] round {rnd} workers={count} {result['req_per_s']:8.1f} req/s "
                          f"p50 {result['latency_p50_ms']} ms p99 {result['latency_p99_ms']} ms "
                          f"gateway {result['gateway_cpu_s'] / result['elapsed_s']:.2f} cores "
                          f"errors {result['errors']} unfinished {result['unfinished']}", flush=True)
        finally:
            cluster.stop()
    info = report.machine({"postgresql": "private cluster on the storage host (initdb per run)",
                           "loadgen": "bench.loadgen (aiohttp, one process, on the client host)"})
    settings = {"worker hosts": args.workers, "rounds": args.rounds, "measured s per point": args.duration,
                "warm-up s": args.warmup, "clients (closed loop)": args.concurrency,
                "request": "non-streaming chat completion, max_tokens 16",
                "worker engine": f"instant, capacity {engine.capacity}, {engine.delay_s * 1000:.0f} ms a request "
                f"(bound {engine.capacity / engine.delay_s:.0f} req/s a worker)",
                "hosts": "network namespaces on one bridge, 192.0.2.0/24: storage (redis-server, PostgreSQL "
                "with fsync off), gateway (1 uvicorn process), worker1..N (1 worker each), client",
                "placement": "not pinned: every host shares the machine's cores",
                "load average before / after": f"{load_before} / {report.load_average()}"}
    write_results(args.out, points, engine, info, settings)
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    (args.out / "raw" / "scale_points.json").write_text(json.dumps(points, indent=1))
    print(f"[scale] wrote {args.out / 'scale.md'}")
    return 0
