"""What travels between gateway and workers: the job kinds (:class:`Endpoint`), the lanes, a
:class:`Job` and the :class:`Reply` entries that answer it, and OpenAI's error envelope. Imports nothing
of ours."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from flatfare.contract.keys import inflight_key, key_inflight_key, reply_stream

# While the standard lane has work, at least this share of a worker's claims go to it.
STANDARD_SHARE = 0.2


class Lane(StrEnum):
    PREMIUM = "premium"
    STANDARD = "standard"
    # Batch API lines (item 9 above): taken only with capacity the live lanes leave idle.
    BATCH = "batch"

    @property
    def priority(self) -> int:
        """vLLM's request priority (``--scheduling-policy priority``): lower runs first."""
        return {Lane.PREMIUM: 0, Lane.STANDARD: 10}.get(self, 20)


# The lanes clients wait on; the batch lane is fed by the gateway's batch dispatcher, not admission.
LIVE_LANES = (Lane.PREMIUM, Lane.STANDARD)


class Endpoint(StrEnum):
    """A job kind: the OpenAI endpoint a job came from and the serving call that runs it.

    This is the one list of kinds. Each side keeps what a kind means to it in one table keyed by
    these: the gateway's wire model, checks and caps (``flatfare.gateway.openai.kinds.KINDS``), the
    worker's vLLM serving object (``flatfare.workers.engine.SERVING``). Adding a kind adds a member
    here (with its path) and a row to each table."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"

    @property
    def path(self) -> str:
        """The HTTP route clients call, as OpenAI names it."""
        return ENDPOINT_PATHS[self]


ENDPOINT_PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETION: "/v1/completions",
                  Endpoint.EMBEDDINGS: "/v1/embeddings", Endpoint.RESPONSES: "/v1/responses"}


class ReplyKind(StrEnum):
    CHUNK = "c"
    RESPONSE = "r"
    ERROR = "e"
    END = "x"
    # Not an answer: the worker still runs the job though its queue entry was lost (item 5 above).
    HELD = "h"

    @property
    def terminal(self) -> bool:
        return self is not ReplyKind.CHUNK and self is not ReplyKind.HELD


def text_of(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Job:
    """One request for one worker: the OpenAI body the gateway has already validated."""

    request_id: str
    endpoint: Endpoint
    body: str
    enqueued_ms: int
    lane: Lane = Lane.STANDARD
    # Wall-clock ms after which a job still queued is dropped (x-flatfare-max-queue-ms); 0: none.
    deadline_ms: int = 0
    # Hash of the prompt's long shared prefix, when there is one (prefix-aware routing).
    prefix: str = ""
    # Where the replies go: the gateway process's reply stream, or the request's own; "" means the
    # request's own (jobs queued by gateways that predate per-process reply streams).
    reply_to: str = ""
    # Whose request it is (0: not known, a job from an older gateway): the worker takes it out of the
    # account's and the key's in-flight sets with its terminal reply.
    account_id: int = 0
    key_id: int = 0
    # The W3C traceparent of the gateway's span for the request (flatfare.tracecontext): the worker runs
    # the job under a span of its own in the same trace. "" (a job from an older gateway): a new trace.
    traceparent: str = ""

    @property
    def priority(self) -> int:
        return self.lane.priority

    @property
    def reply_key(self) -> str:
        return self.reply_to or reply_stream(self.request_id)

    def to_fields(self) -> dict[str, str]:
        fields = {
            "id": self.request_id,
            "ep": self.endpoint.value,
            "body": self.body,
            "t": str(self.enqueued_ms),
            "l": self.lane.value,
            "dl": str(self.deadline_ms),
            "px": self.prefix,
            "rt": self.reply_to,
            "a": str(self.account_id),
            "k": str(self.key_id),
        }
        if self.traceparent:
            fields["tp"] = self.traceparent
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> Job:
        f = {text_of(k): text_of(v) for k, v in fields.items()}
        return cls(
            request_id=f["id"],
            endpoint=Endpoint(f["ep"]),
            body=f["body"],
            enqueued_ms=int(f["t"]),
            lane=Lane(f.get("l", Lane.STANDARD.value)),
            deadline_ms=int(f.get("dl", "0")),
            prefix=f.get("px", ""),
            reply_to=f.get("rt", ""),
            account_id=int(f.get("a", "0")),
            key_id=int(f.get("k", "0")),
            traceparent=f.get("tp", ""),
        )

    def inflight_keys(self) -> list[str]:
        """The in-flight sets (:func:`inflight_key`, :func:`key_inflight_key`) the request is in."""
        keys = [inflight_key(self.account_id)] if self.account_id else []
        return keys + [key_inflight_key(self.key_id)] if self.key_id else keys


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope: the body of every error answer, and the data of an ``ERROR`` reply."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class Reply:
    """One entry of a reply stream.

    ``data`` is, by kind: CHUNK, the JSON of one SSE event (without ``data: ``); RESPONSE, the
    JSON body; ERROR, the OpenAI error body (:func:`error_body`); END and HELD, empty. ``status``
    is the HTTP status for RESPONSE and ERROR. ``usage`` is set on RESPONSE and END.
    ``started_ms`` (the worker's wall clock when it took the job) is on the first CHUNK and on
    terminal replies; ``first_token_ms`` (when the engine produced its first output, 0 when none
    came) is on terminal replies.
    """

    kind: ReplyKind
    data: str = ""
    status: int = 200
    usage: Usage | None = None
    started_ms: int = 0
    first_token_ms: int = 0

    def to_fields(self, request_id: str = "") -> dict[str, str]:
        """The stream entry; ``request_id`` names the request in a stream shared by many."""
        fields = {"i": request_id, "k": self.kind.value, "d": self.data} if request_id else \
            {"k": self.kind.value, "d": self.data}
        if self.started_ms:
            fields["q"] = str(self.started_ms)
        if self.kind is not ReplyKind.CHUNK:
            fields["s"] = str(self.status)
            fields["f"] = str(self.first_token_ms)
            if self.usage is not None:
                fields["u"] = json.dumps(asdict(self.usage))
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> Reply:
        f = {text_of(k): text_of(v) for k, v in fields.items()}
        usage = Usage(**json.loads(f["u"])) if "u" in f else None
        return cls(
            kind=ReplyKind(f["k"]),
            data=f.get("d", ""),
            status=int(f.get("s", "200")),
            usage=usage,
            started_ms=int(f.get("q", "0")),
            first_token_ms=int(f.get("f", "0")),
        )

    @classmethod
    def from_entry(cls, fields: dict[bytes, bytes]) -> Reply:
        """From a raw stream entry (bytes, as redis-py returns it): the gateway's hot path."""
        get = fields.get
        kind = _KINDS[get(b"k", b"c")]
        if kind is ReplyKind.CHUNK:
            started = get(b"q")
            return cls(kind, get(b"d", b"").decode(), started_ms=int(started) if started else 0)
        usage = get(b"u")
        return cls(kind, get(b"d", b"").decode(), int(get(b"s", b"200")),
                   Usage(**json.loads(usage)) if usage else None, int(get(b"q", b"0")), int(get(b"f", b"0")))


_KINDS = {kind.value.encode(): kind for kind in ReplyKind}


