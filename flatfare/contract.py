"""The contract between gateway and workers: Redis key names and the job/reply formats.

Both sides import this module and nothing else of each other; it imports nothing of ours.

Request path in Redis terms:

1. The gateway XADDs a :class:`Job` to ``job_stream(model)``. Every worker of the model's pool
   reads that stream through the consumer group :data:`POOL_GROUP`, so each job goes to one worker.
2. The worker XADDs :class:`Reply` entries to ``reply_stream(request_id)``: zero or more
   ``CHUNK`` entries (one SSE ``data:`` payload each) then exactly one terminal entry:
   ``RESPONSE`` (a whole non-streaming body), ``ERROR`` (status + OpenAI error body) or ``END``
   (a stream finished; carries the usage).
3. The worker XACKs (and XDELs) the job only once its terminal reply is written.
4. A client that goes away makes the gateway PUBLISH the request id on :data:`CANCEL_CHANNEL` and
   set ``cancel_key(request_id)``; the worker aborts the engine request, or skips the job if it
   had not started it yet.
5. Workers announce themselves every :data:`HEARTBEAT_INTERVAL_S` in ``pool_key(model)`` (a sorted
   set scored by the last heartbeat, in ms) and ``worker_key(worker_id)`` (a hash of
   :class:`WorkerInfo`). A worker is live while its heartbeat is younger than :data:`WORKER_TTL_S`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

PREFIX = "ff"
POOL_GROUP = "pool"
CANCEL_CHANNEL = f"{PREFIX}:cancel"
POOLS_KEY = f"{PREFIX}:pools"

HEARTBEAT_INTERVAL_S = 1.0
WORKER_TTL_S = 5.0
# A reply stream outlives its request by this much, so a gateway that died mid-read leaves no garbage.
REPLY_TTL_S = 600
CANCEL_TTL_S = 600


def job_stream(model: str) -> str:
    return f"{PREFIX}:jobs:{{{model}}}"


def reply_stream(request_id: str) -> str:
    return f"{PREFIX}:reply:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def pool_key(model: str) -> str:
    return f"{PREFIX}:pool:{{{model}}}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


class ReplyKind(StrEnum):
    CHUNK = "c"
    RESPONSE = "r"
    ERROR = "e"
    END = "x"

    @property
    def terminal(self) -> bool:
        return self is not ReplyKind.CHUNK


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Job:
    """One request for one worker: the OpenAI body the gateway has already validated."""

    request_id: str
    endpoint: Endpoint
    body: str
    enqueued_ms: int
    priority: int = 0

    def to_fields(self) -> dict[str, str]:
        return {
            "id": self.request_id,
            "ep": self.endpoint.value,
            "body": self.body,
            "t": str(self.enqueued_ms),
            "p": str(self.priority),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> Job:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            request_id=f["id"],
            endpoint=Endpoint(f["ep"]),
            body=f["body"],
            enqueued_ms=int(f["t"]),
            priority=int(f.get("p", "0")),
        )


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Reply:
    """One entry of a reply stream.

    ``data`` is, by kind: CHUNK, the JSON of one SSE event (without ``data: ``); RESPONSE, the
    JSON body; ERROR, the OpenAI error body; END, empty. ``status`` is the HTTP status for
    RESPONSE and ERROR. ``usage`` is set on RESPONSE and END. On terminal replies,
    ``started_ms`` is the worker's wall clock when it took the job and ``first_token_ms`` when the
    engine produced the first output (0 when none came).
    """

    kind: ReplyKind
    data: str = ""
    status: int = 200
    usage: Usage | None = None
    started_ms: int = 0
    first_token_ms: int = 0

    def to_fields(self) -> dict[str, str]:
        fields = {"k": self.kind.value, "d": self.data}
        if self.kind is not ReplyKind.CHUNK:
            fields["s"] = str(self.status)
            fields["q"] = str(self.started_ms)
            fields["f"] = str(self.first_token_ms)
            if self.usage is not None:
                fields["u"] = json.dumps(asdict(self.usage))
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> Reply:
        f = {_text(k): _text(v) for k, v in fields.items()}
        usage = Usage(**json.loads(f["u"])) if "u" in f else None
        return cls(
            kind=ReplyKind(f["k"]),
            data=f.get("d", ""),
            status=int(f.get("s", "200")),
            usage=usage,
            started_ms=int(f.get("q", "0")),
            first_token_ms=int(f.get("f", "0")),
        )


@dataclass(slots=True)
class WorkerInfo:
    """What a worker announces with each heartbeat."""

    worker_id: str
    model: str
    max_model_len: int
    capacity: int
    inflight: int = 0
    started_ms: int = 0
    engine: str = "vllm"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_fields(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "model": self.model,
            "max_model_len": str(self.max_model_len),
            "capacity": str(self.capacity),
            "inflight": str(self.inflight),
            "started_ms": str(self.started_ms),
            "engine": self.engine,
            "extra": json.dumps(self.extra),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> WorkerInfo:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            worker_id=f["worker_id"],
            model=f["model"],
            max_model_len=int(f["max_model_len"]),
            capacity=int(f["capacity"]),
            inflight=int(f.get("inflight", "0")),
            started_ms=int(f.get("started_ms", "0")),
            engine=f.get("engine", "vllm"),
            extra=json.loads(f.get("extra", "{}")),
        )
