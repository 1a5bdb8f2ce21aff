"""The fleet's worker processes: starting one, what it last said in its heartbeat, and what it was told."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flatfare.contract import WorkerInfo, WorkerState
from flatfare.fleet.decisions import Act, Engine

# A command not acted on within this long (the worker's heartbeat still shows the state it was in) was
# lost or ignored: the fleet decides again from what the worker says.
COMMAND_ACK_S = 10.0


@dataclass(slots=True)
class Told:
    """A SLEEP or WAKE sent to the worker, not yet seen done."""

    act: Act
    sent_ms: int
    level: int = 0


@dataclass(slots=True)
class Child:
    worker_id: str
    model: str
    slots: tuple[str, ...]
    process: subprocess.Popen[bytes]
    log_path: Path
    started_ms: int
    # What its last heartbeat said (STARTING until it sends one).
    info: WorkerInfo | None = None
    told: Told | None = None
    # SIGTERM sent: it drains and exits.
    stopping: bool = False
    # When it last became warm (ms): an engine never used counts as used then.
    warm_since_ms: int = 0
    events: list[str] = field(default_factory=list)

    @property
    def reported(self) -> WorkerState:
        return self.info.state if self.info is not None else WorkerState.STARTING

    def state(self, now_ms: int) -> WorkerState:
        """Its state as the fleet counts it: what it was told to become until its heartbeat shows it."""
        if self.stopping:
            return WorkerState.DRAINING
        reported = self.reported
        if self.told is None:
            return reported
        done = WorkerState.ASLEEP if self.told.act is Act.SLEEP else WorkerState.WARM
        before = WorkerState.WARM if self.told.act is Act.SLEEP else WorkerState.ASLEEP
        if reported is done or (reported is before and now_ms - self.told.sent_ms > COMMAND_ACK_S * 1000):
            if reported is before:
                self.events.append(f"the worker did not act on {self.told.act.value} within {COMMAND_ACK_S:.0f} s")
            self.told = None
            return reported
        return WorkerState.SLEEPING if self.told.act is Act.SLEEP else WorkerState.WAKING

    def sleep_refused(self) -> str:
        return str(self.info.extra.get("sleep_refused") or "") if self.info is not None else ""

    def engine(self, now_ms: int) -> Engine:
        info = self.info
        state = self.state(now_ms)
        if state is WorkerState.WARM and not self.warm_since_ms:
            self.warm_since_ms = now_ms
        elif state is not WorkerState.WARM:
            self.warm_since_ms = 0
        level = self.told.level if self.told is not None and self.told.act is Act.SLEEP else 0
        if info is not None and state is WorkerState.ASLEEP:
            level = int(info.extra.get("sleep_level") or 1)
        return Engine(self.worker_id, self.model, state, self.slots,
                      last_used_ms=max(info.last_used_ms if info else 0, self.warm_since_ms),
                      inflight=info.inflight if info else 0, sleep_level=level)

    def phase(self) -> str:
        """What a starting engine is doing, as its heartbeat says ("" before its first)."""
        return str(self.info.extra.get("phase") or "") if self.info is not None else ""

    def terminate(self) -> None:
        self.stopping = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


def spawn(worker_id: str, model: str, fleet_id: str, slots: tuple[str, ...], gpu: bool, log_path: Path,
          now_ms: int) -> Child:
    """``python -m flatfare worker --model M --fleet F`` on ``slots``, logging to ``log_path``."""
    # Its id is the fleet's choice, so the fleet reads its heartbeat and sends it commands from the start.
    env = {**os.environ, "FLATFARE_WORKER_ID": worker_id}
    if gpu:
        # The worker sees only its own GPUs, and starts its engine ready to sleep.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slots)
        env["FLATFARE_SLEEP_MODE"] = "1"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # A session of its own: a Ctrl-C meant for the fleet reaches it only through the fleet, which
        # lets it drain.
        process = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--model", model, "--fleet", fleet_id],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Child(worker_id, model, slots, process, log_path, now_ms)


def log_name(model: str, n: int) -> str:
    return f"worker-{re.sub(r'[^A-Za-z0-9._-]', '_', model)}-{n}.log"


def last_line(path: Path) -> str:
    """Why a worker stopped, from the end of its log: the last line naming an error (the exception's
    own line, not the traceback's tail), else the last line; a JSON line's message; at most 200
    characters."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(path.stat().st_size - 8192, 0))
            lines = [ln.strip() for ln in handle.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    if not lines:
        return ""
    errors = [ln for ln in lines[-30:] if re.search(r"(Error|Exception)\b|^error:", ln)]
    line = errors[-1] if errors else lines[-1]
    match = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', line)
    return (match.group(1) if match else line)[-200:]
