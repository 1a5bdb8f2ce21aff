"""How workers and fleet supervisors say what they are and are told what to do: a worker's heartbeat
(:class:`WorkerInfo`, its :class:`WorkerState`), a fleet's (:class:`FleetStatus`), the commands a
fleet sends its workers (:class:`Command`), and what a model's engines took to start
(:class:`ModelFacts`). Imports nothing of ours."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from flatfare.contract.jobs import text_of


class WorkerState(StrEnum):
    STARTING = "starting"
    WARM = "warm"
    DRAINING = "draining"
    # Told to sleep: finishing its jobs, claiming no more, then freeing its accelerator memory.
    SLEEPING = "sleeping"
    # The engine sleeps (vLLM sleep mode: weights in host RAM at level 1, dropped at level 2).
    ASLEEP = "asleep"
    WAKING = "waking"


class CommandKind(StrEnum):
    SLEEP = "sleep"
    WAKE = "wake"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Command:
    """What a fleet supervisor tells one of its workers (item 8 above)."""

    kind: CommandKind
    # SLEEP: vLLM's sleep level (1: weights kept in host RAM; 2: dropped, reloaded at wake).
    level: int = 1
    # Issued at (ms): a worker ignores a command older than its own last state change.
    issued_ms: int = 0

    def encode(self) -> str:
        return json.dumps({"kind": self.kind.value, "level": self.level, "t": self.issued_ms})

    @classmethod
    def decode(cls, raw: bytes | str) -> Command:
        data = json.loads(raw)
        return cls(CommandKind(data["kind"]), int(data.get("level", 1)), int(data.get("t", 0)))


@dataclass(slots=True)
class FleetStatus:
    """What a fleet supervisor heartbeats (item 8 above): gateways read ``models`` and ``waiting`` to
    admit a request for a cold model and to say why it cannot start; ``flatfare fleet status`` and the
    admin API show the rest."""

    fleet_id: str
    host: str
    # "cpu" or "gpu"; the accelerator slots it owns ("0", "1", ... GPU ids, or one "cpu" slot).
    accelerator: str = "cpu"
    slots: list[str] = field(default_factory=list)
    # The budget: engines awake at once, and host memory (GiB) for level-1 sleeping engines' weights.
    max_awake: int = 1
    host_memory_gb: float = 0.0
    # How often it decides (s).
    tick_s: float = 0.0
    # The catalog models this fleet can start (enabled, fitting its slots).
    models: list[str] = field(default_factory=list)
    # Its engines: worker id -> {"model", "state", "slots", "pid", "last_used_ms", "sleep_level"}.
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Models with queued demand it cannot serve yet -> why (no free slot, starting, a failed start).
    waiting: dict[str, str] = field(default_factory=dict)
    # Its last decisions, newest last: {"t": ms, "action", "model", "worker_id", "why"}.
    decisions: list[dict[str, Any]] = field(default_factory=list)
    updated_ms: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> FleetStatus:
        return cls(**json.loads(raw))


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The last measured start and wake of a model's engine (seconds; 0: never measured)."""

    max_model_len: int = 0
    start_s: float = 0.0
    wake_s: float = 0.0

    def to_fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if v}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> ModelFacts:
        f = {text_of(k): text_of(v) for k, v in fields.items()}
        return cls(int(f.get("max_model_len", "0")), float(f.get("start_s", "0")), float(f.get("wake_s", "0")))


@dataclass(slots=True)
class WorkerInfo:
    """What a worker announces with each heartbeat."""

    worker_id: str
    model: str
    max_model_len: int
    capacity: int
    inflight: int = 0
    # The pool it serves: the model's name, or model@pool for a dedicated pool.
    pool: str = ""
    started_ms: int = 0
    engine: str = "vllm"
    state: WorkerState = WorkerState.WARM
    extra: dict[str, Any] = field(default_factory=dict)
    # When it last took or finished a job (ms; 0: never): its fleet puts the least recently used to sleep.
    last_used_ms: int = 0
    # The fleet supervisor that started it ("" for a worker started on its own): only that fleet commands it.
    fleet: str = ""

    @property
    def free(self) -> int:
        return max(self.capacity - self.inflight, 0)

    def to_fields(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "model": self.model,
            "max_model_len": str(self.max_model_len),
            "capacity": str(self.capacity),
            "inflight": str(self.inflight),
            "pool": self.pool or self.model,
            "started_ms": str(self.started_ms),
            "engine": self.engine,
            "state": self.state.value,
            "extra": json.dumps(self.extra),
            "used": str(self.last_used_ms),
            "fleet": self.fleet,
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> WorkerInfo:
        f = {text_of(k): text_of(v) for k, v in fields.items()}
        return cls(
            worker_id=f["worker_id"],
            model=f["model"],
            max_model_len=int(f["max_model_len"]),
            capacity=int(f["capacity"]),
            inflight=int(f.get("inflight", "0")),
            pool=f.get("pool", f["model"]),
            started_ms=int(f.get("started_ms", "0")),
            engine=f.get("engine", "vllm"),
            state=WorkerState(f.get("state", WorkerState.WARM.value)),
            extra=json.loads(f.get("extra", "{}")),
            last_used_ms=int(f.get("used", "0")),
            fleet=f.get("fleet", ""),
        )
