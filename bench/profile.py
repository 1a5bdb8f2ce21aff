"""Benchmark 4: where the gateway's and the worker's CPU goes under the overhead load (py-spy).

Starts the same Flatfare stack as ``overhead`` (instant engine), drives it with ``bench.loadgen``
(non-streaming and streaming, in turn) and samples the gateway and the worker with ``py-spy record``
at the same time. Writes the collapsed stacks (``profile_*.txt.gz``, for any flamegraph viewer) and
``profile.md``: the top functions by own time and by inclusive time, and own time by package.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import overhead, report
from bench.procs import services
from bench.stack import FlatfareStack

# Frames every sample of a thread passes through (entry points, the event loop): they name no cost.
_ENTRY_FILES = ("runpy", "threading.py", "typer/", "click/", "uvicorn/main.py", "uvicorn/server.py",
                "uvicorn/_compat.py", "asyncio/runners.py", "asyncio/base_events.py", "asyncio/events.py",
                "flatfare/cli/main.py", "flatfare/__main__.py", "workers/main.py", "uvloop/")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds sampled per mode")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--postgres", metavar="SERVER_URL", default="",
                        help="run the ledger on a temporary PostgreSQL database instead of SQLite")
    parser.add_argument("--server", default="uvicorn", choices=["uvicorn", "granian"], help="the gateway's HTTP server")
    parser.add_argument("--quick", action="store_true", help="5 s per mode")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def _package(path: str) -> str:
    """A frame's file as a package name: site-packages/<pkg>/..., our own top folders, or the stdlib module."""
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python3" in path:
        path = path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    elif "/work/main/" in path:
        path = path.split("/work/main/", 1)[1]
    # py-spy names files relative to sys.path where it can: the first part is the package.
    first = path.lstrip("<").split("/", 1)[0].removesuffix(".py").removesuffix(">")
    if first in sys.stdlib_module_names or first.startswith("frozen"):
        return f"{first} (stdlib)"
    return first


def _short(frame: str) -> str:
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    if "/lib/python3" in path:
        path = path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    return f"{match['func']} ({path})"


def analyse(collapsed: str, top: int = 15) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]],
                                                    list[tuple[str, int]]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += count
        own[_short(frames[-1])] += count
        match = _FRAME.match(frames[-1])
        packages[_package(match["file"]) if match else "?"] += count
        for name in {_short(f) for f in frames}:
            if not any(entry in name for entry in _ENTRY_FILES):
                inclusive[name] += count
    return total, own.most_common(top), inclusive.most_common(top), packages.most_common(top)


def _table(rows: list[tuple[str, int]], total: int) -> str:
    return report.markdown_table(["what", "share of samples"],
                                 [(name.replace("|", "\\|"), f"{100 * n / total:.1f} %") for name, n in rows])


def run(args: argparse.Namespace) -> int:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is missing: scripts/install.sh bench", file=sys.stderr)
        return 2
    if args.quick:
        args.duration = 5.0
    proxy_cpus, rest_cpus = overhead.placement(False)
    load_before = report.load_average()
    report.mark_start()
    suffix = ("_pg" if args.postgres else "") + ("_granian" if args.server == "granian" else "")
    # granian serves from a child process of the one started.
    children = ["--subprocesses"] if args.server == "granian" else []
    sections = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ff-bench-profile-") as tmp, services() as group:
        workdir = Path(tmp)
        stack = FlatfareStack(group, workdir / "flatfare", overhead.MODEL, ["--engine", "instant"],
                              extra_env={"FLATFARE_INSTANT_TOKENS": str(overhead.TOKENS), "FLATFARE_SERVER": args.server},
                              gateway_cpus=proxy_cpus, worker_cpus=rest_cpus, redis_cpus=rest_cpus,
                              postgres_server=args.postgres)
        try:
            stack.start_storage()
            stack.start_worker(60)
            stack.start_gateway(60)
            url = stack.base_url + overhead.CHAT_PATH
            for stream in (False, True):
                tag = "stream" if stream else "nonstream"
                spies = {}
                # "gateway-gil" samples only the thread holding the GIL: the gateway's Python CPU. The plain
                # samplers see every active thread, including ones blocked inside C (SQLite's lock waits).
                for name, pid, extra in (("gateway", stack.gateway.pid, children),  # type: ignore[union-attr]
                                         ("gateway-gil", stack.gateway.pid, ["--gil", *children]),  # type: ignore[union-attr]
                                         ("worker", stack.worker.pid, [])):  # type: ignore[union-attr]
                    raw = workdir / f"{name}_{tag}.txt"
                    spies[name] = (raw, subprocess.Popen(
                        [py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                         "--nonblocking", "--duration", str(int(args.duration)), "--output", str(raw), *extra],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
                time.sleep(0.5)
                result = overhead.loadgen(url, stack.key, args.concurrency, stream, args.duration, 0.0,
                                          stack.pids(), rest_cpus)
                for name, (raw, spy) in spies.items():
                    spy.wait(timeout=60)
                    collapsed = raw.read_text() if raw.exists() else ""
                    with gzip.open(args.out / f"profile{suffix}_{name}_{tag}.txt.gz", "wt") as handle:
                        handle.write(collapsed)
                    total, own, incl, pkgs = analyse(collapsed)
                    if not total:
                        sections.append((f"{name}, {tag}", "no samples (py-spy failed: "
                                         f"{spy.stderr.read().decode()[-300:] if spy.stderr else ''})"))
                        continue
                    cpu = result.get(f"{name.removesuffix('-gil')}_cpu_s")
                    head = (f"{total} samples; load: {result['req_per_s']:.0f} req/s at concurrency "
                            f"{args.concurrency}; {name} CPU {cpu} s in {result['elapsed_s']} s "
                            f"({1000 * cpu / max(result['completed'], 1):.2f} ms a request).")
                    sections.append((f"{name}, {tag}: own time by package", head + "\n\n" + _table(pkgs, total)))
                    sections.append((f"{name}, {tag}: top functions, own time", _table(own, total)))
                    sections.append((f"{name}, {tag}: top functions, inclusive", _table(incl, total)))
                print(f"[profile] {tag}: {result['req_per_s']:.0f} req/s", flush=True)
        finally:
            stack.stop()
    settings = {"concurrency": args.concurrency, "seconds per mode": args.duration, "py-spy rate": args.rate,
                "py-spy": "record --nonblocking --format raw (idle samples excluded)",
                "placement": f"gateway on CPU {proxy_cpus}, the rest on CPU {rest_cpus}" if proxy_cpus else "not pinned",
                "load average before / after": f"{load_before} / {report.load_average()}"}
    settings["ledger database"] = "PostgreSQL (temporary database)" if args.postgres else "SQLite file"
    settings["gateway server"] = args.server
    report.write_markdown(args.out / f"profile{suffix}.md", "Profile: gateway and worker under the overhead load",
                          __doc__.split("\n\n", 1)[1], report.machine(), settings, sections)
    print(f"[profile] wrote {args.out / f'profile{suffix}.md'}")
    return 0
