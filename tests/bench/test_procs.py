"""A benchmark stopped by SIGTERM (``timeout``, an operator) stops the platform it started: every child runs in a
session of its own (so it can be stopped with its children), and nothing else would end it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from tests.conftest import eventually

BENCHMARK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from bench.__main__ import exit_on_termination
    from bench.procs import Service, services

    exit_on_termination()
    with services() as started:
        child = started.start(Service("sleeper", ["sleep", "300"], Path(sys.argv[1])))
        print(child.pid, flush=True)
        time.sleep(300)
""")


def test_a_benchmark_ended_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    child = 0
    bench = subprocess.Popen([sys.executable, "-c", BENCHMARK, str(tmp_path / "sleeper.log")],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        child = int(bench.stdout.readline())  # type: ignore[union-attr]
        assert psutil.pid_exists(child)
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        eventually(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
                   bool, "the benchmark's child gone")
    finally:
        bench.kill()
        bench.wait()
        if child and psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)
