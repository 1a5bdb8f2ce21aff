"""What a starting worker says about its engine's start: the phase it is in and since when.

Most of a start happens inside vLLM's engine constructor, which blocks the worker's event loop (and
so its heartbeat) until the engine is ready, and in the engine's own processes, whose log records
never reach this one. So while the worker starts, a thread heartbeats it (``starting``, with
``extra["phase"]`` and ``extra["phase_since_ms"]``), and every engine process writes vLLM's log
records to one file too (a handler added to the logging configuration the worker hands vLLM), which
the thread reads to follow the phase: loading weights, compiling, capturing graphs, warming up.
``extra["expected_start_s"]`` is the last measured start of the model (``ModelFacts.start_s``), so a
person waiting sees roughly how long is left.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import redis

from flatfare import contract
from flatfare.contract import WorkerInfo
from flatfare.workers.presence import now_ms, queue_beat

log = logging.getLogger("flatfare.worker")

PREPARING = "preparing the model"
STARTING_ENGINE = "starting the engine"
# vLLM's log lines (0.26 and 0.32, CPU and GPU) that mark a phase of its start, in start order.
_VLLM_PHASES = [
    (re.compile(r"Starting to load model|Loading weights|Loading safetensors"), "loading weights"),
    (re.compile(r"Warming up model for the compilation"), "compiling for the CPU"),
    (re.compile(r"Dynamo bytecode transform|Compiling a graph|torch\.compile"), "compiling the model"),
    (re.compile(r"Capturing CUDA graphs|Graph capturing"), "capturing graphs"),
    (re.compile(r"Warming up done|KV cache size|Available KV cache memory|init engine \(profile"), "warming up"),
]


def vllm_phase(message: str) -> str | None:
    """The start phase a vLLM log line says the engine entered, if any."""
    for pattern, phase in _VLLM_PHASES:
        if pattern.search(message):
            return phase
    return None


def with_phase_log(logging_config: dict[str, Any], path: Path) -> dict[str, Any]:
    """``logging_config`` (a dictConfig mapping) whose vLLM records also go, as bare messages, to ``path``."""
    config = {**logging_config, "formatters": {**logging_config.get("formatters", {}),
                                                "phase": {"format": "%(message)s"}}}
    config["handlers"] = {**config.get("handlers", {}),
                          "phase": {"class": f"{__name__}.PhaseFileHandler", "filename": str(path),
                                    "formatter": "phase", "level": "INFO"}}
    loggers = {**config.get("loggers", {})}
    vllm = {**loggers.get("vllm", {"level": "INFO", "propagate": False})}
    vllm["handlers"] = [*vllm.get("handlers", []), "phase"]
    loggers["vllm"] = vllm
    config["loggers"] = loggers
    return config


class PhaseFileHandler(logging.Handler):
    """Appends records to ``filename`` while it exists. The worker deletes it once its engine started;
    the engine's processes, which keep this handler for their lifetime, then write nothing more."""

    def __init__(self, filename: str) -> None:
        super().__init__()
        self.filename = filename
        self._gone = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._gone:
            return
        try:
            # No O_CREAT: once the worker removed the file, it stays removed.
            handle = os.open(self.filename, os.O_WRONLY | os.O_APPEND)
        except OSError:
            self._gone = True
            return
        try:
            os.write(handle, (self.format(record) + "\n").encode(errors="replace"))
        finally:
            os.close(handle)


class StartProgress:
    """Heartbeats a starting worker from a thread until :meth:`stop`, following its phase."""

    def __init__(self, redis_url: str, info: WorkerInfo, phase_log: Path | None = None) -> None:
        self.redis_url = redis_url
        self.info = info
        self.phase_log = phase_log
        self._lock = threading.Lock()  # info is read by the beat while the event loop sets the phase
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="start-heartbeat", daemon=True)
        self._read = 0

    def start(self) -> None:
        if self.phase_log is not None:
            self.phase_log.touch()
        self._thread.start()

    def enter(self, phase: str) -> None:
        with self._lock:
            if self.info.extra.get("phase") != phase:
                self.info.extra["phase"] = phase
                self.info.extra["phase_since_ms"] = now_ms()
                log.info("start: %s", phase)

    def stop(self) -> None:
        """End the thread's heartbeats (the event loop's take over) and drop the phase fields."""
        self._done.set()
        self._thread.join()
        with self._lock:
            for key in ("phase", "phase_since_ms", "expected_start_s"):
                self.info.extra.pop(key, None)

    def _follow_log(self) -> None:
        if self.phase_log is None:
            return
        with self.phase_log.open("rb") as file:
            file.seek(self._read)
            data = file.read()
        complete = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._read += complete
        for line in data[:complete].decode(errors="replace").splitlines():
            phase = vllm_phase(line)
            if phase is not None:
                self.enter(phase)

    def _beat(self) -> None:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
        try:
            while not self._done.is_set():
                try:
                    self._follow_log()
                    with self._lock, client.pipeline(transaction=False) as pipe:
                        queue_beat(pipe, self.info, now_ms())
                        pipe.execute()
                except (redis.RedisError, OSError):
                    log.warning("heartbeat while starting failed; retrying", exc_info=True)
                self._done.wait(contract.HEARTBEAT_INTERVAL_S)
        finally:
            client.close()
