"""Child processes the benchmarks start: pinned, logged, CPU-accounted, and always stopped."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def pinned(argv: Sequence[str], cpus: str | None) -> list[str]:
    """``argv`` under ``taskset -c cpus`` when pinning is asked for and possible."""
    if cpus is None or shutil.which("taskset") is None:
        return list(argv)
    return ["taskset", "-c", cpus, *argv]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its living descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


@dataclass
class Service:
    """One long-running child (a server), in its own session so it can be stopped with its children."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Service:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, needs: Sequence[Service] = ()) -> float:
        """Poll ``probe`` until it says yes; the seconds it took. Fails if the child (or one it ``needs``)
        exits, or time runs out."""
        started = time.monotonic()
        while True:
            for service in (self, *needs):
                if not service.alive():
                    raise RuntimeError(f"{service.name} exited while starting; last lines of {service.log_path}:\n"
                                       + tail(service.log_path))
            with contextlib.suppress(Exception):
                if probe():
                    return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log_path}:\n"
                                   + tail(self.log_path))
            time.sleep(0.25)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Children that outlived their parent (vLLM's engine core) share its process group: kill them
        # and wait until they are gone, so the next engine finds the memory (and the GPU) free.
        deadline = time.monotonic() + 30
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
            while time.monotonic() < deadline:
                os.killpg(self.process.pid, 0)
                time.sleep(0.2)
        self.process = None


class Services:
    """Every service a benchmark started, stopped in reverse order on exit, whatever happened."""

    def __init__(self) -> None:
        self._started: list[Service] = []

    def start(self, service: Service) -> Service:
        self._started.append(service.start())
        return service

    def stop(self, service: Service) -> None:
        service.stop()
        if service in self._started:
            self._started.remove(service)

    def stop_all(self) -> None:
        for service in reversed(self._started):
            with contextlib.suppress(Exception):
                service.stop()
        self._started.clear()


@contextlib.contextmanager
def services() -> Iterator[Services]:
    group = Services()
    try:
        yield group
    finally:
        group.stop_all()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
