"""The contract between gateway and workers: Redis key names and the job/reply formats.

Both sides import this module and nothing else of each other; it imports nothing of ours.

Request path in Redis terms:

1. The gateway's admission script XADDs a :class:`Job` to its account's queue on its lane,
   ``account_queue(model, lane, account_id)``, puts the account at the back of the lane's ring
   ``lane_ring(model, lane)`` if it was not there, counts it in ``queued_key(model, lane)`` and rings
   ``wake_stream(model)``; or, when prefix-aware routing picked a worker that served the same prompt
   prefix recently and has room, XADDs it to that worker's own stream ``worker_stream(model,
   worker_id)``. The same script counts the request in its account's and key's in-flight sets
   (``inflight_key``, ``key_inflight_key``). A worker's claim script serves its own stream first,
   then premium, then standard, with a guaranteed share for standard (:data:`STANDARD_SHARE`); within
   a lane it takes one job per account in turn (the ring), moving each into the lane's stream
   ``job_stream(model, lane)``, which every worker of the pool reads through the consumer group
   :data:`POOL_GROUP`: a job taken is pending there, under the worker's lease.
2. The worker XADDs :class:`Reply` entries to the job's ``reply_to`` stream: the gateway process's
   own ``gateway_replies(gateway_id)`` (each entry names its request), or, for an idempotent
   request, the request's own ``reply_stream(request_id)``, kept for replays. Zero or more
   ``CHUNK`` entries (one SSE ``data:`` payload each) then exactly one terminal entry:
   ``RESPONSE`` (a whole non-streaming body), ``ERROR`` (status + OpenAI error body) or ``END``
   (a stream finished; carries the usage).
3. The worker takes the request out of its in-flight sets in the same batch as its terminal reply,
   just before it (the gateway takes out those that end otherwise), and XACKs (and XDELs) the job
   only once its terminal reply is written. While it runs a
   job it renews its lease (XCLAIM to itself, which resets the idle time) every
   ``lease/3``; a job idle longer than its lease belongs to a worker that died, and any live worker
   takes it over with XAUTOCLAIM: it runs the job again unless ``begun_key(request_id)`` says a
   chunk already went out (set with the first chunk, deleted with the ack), in which case it fails
   it cleanly (an ERROR reply): the client already got part of the answer.
4. A client that goes away makes the gateway PUBLISH the request id on :data:`CANCEL_CHANNEL` and
   set ``cancel_key(request_id)``; the worker aborts the engine request, or skips the job if it
   had not started it yet.
5. A Redis that lost its data lost the queued jobs and the leases with it. A worker that finds the
   entries of jobs it runs gone (its lease renewal claims nothing) says it still has each of them
   every :data:`HELD_EVERY_S` with a ``HELD`` reply (no data; readers skip it). After a loss the
   gateway answers a request that hears nothing, not even that, for its grace period: its job was
   lost with the data (503 ``job_lost``, free).
6. Workers announce themselves every :data:`HEARTBEAT_INTERVAL_S` in ``pool_key(model)`` (a sorted
   set scored by the last heartbeat, in ms) and ``worker_key(worker_id)`` (a hash of
   :class:`WorkerInfo`). A worker is live while its heartbeat is younger than :data:`WORKER_TTL_S`.
7. A worker publishes its model's tokenizer at start (and again whenever it is gone) in
   ``tokenizer_key(model)``: a hash of :data:`TOKENIZER_DIGEST`, the SHA-256 of :data:`TOKENIZER_JSON`,
   its ``tokenizer.json``. Gateways count a long prompt's tokens with it before the request is counted
   or queued, and reload it only when the digest changes.
8. Models on demand (``flatfare fleet``): a fleet supervisor heartbeats its :class:`FleetStatus` in
   ``fleet_key(fleet_id)`` and ``FLEETS_KEY`` (a sorted set by last heartbeat, ms). It starts workers
   for models with queued demand (:func:`queued_key` of both lanes), keeps pinned ones up, and tells
   an idle worker to sleep, wake or stop by RPUSHing a :class:`Command` on ``worker_commands(worker_id)``,
   which the worker BLPOPs. An asleep worker heartbeats ``asleep`` and claims nothing. What every start
   and wake took is kept in ``model_facts_key(model)`` (a hash, no expiry), so a gateway can say how long
   a cold model will take and check a prompt's length against a model with no live worker.
9. The Batch API: one gateway process at a time (``BATCH_LEADER_KEY``) XADDs a batch's lines, a few
   at a time, as jobs straight into the pool's batch lane, ``job_stream(model, Lane.BATCH)`` (no
   accounts' queues, no quota), only while both live lanes have nothing queued. A worker's claim
   script reads it after the live lanes, and only while they have nothing waiting and the worker
   has free slots beyond a reserve kept for live traffic. Replies go to ``BATCH_REPLIES``.
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
# A claimed job whose worker has not renewed it for this long is taken over by another worker.
DEFAULT_LEASE_S = 15.0
# While the standard lane has work, at least this share of a worker's claims go to it.
STANDARD_SHARE = 0.2
WORKER_TTL_S = 5.0
# How often a worker running jobs whose queue entries were lost (Redis lost its data) says so.
HELD_EVERY_S = 2.0
# A reply stream outlives its request by this much, so a gateway that died mid-read leaves no garbage.
REPLY_TTL_S = 600
CANCEL_TTL_S = 600
# Gateway processes by their last sign of life (ms): a sorted set.
GATEWAYS_KEY = f"{PREFIX}:gateways"


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


def pool_name(model: str, dedicated: str | None = None) -> str:
    """The pool serving ``model``: the shared one, or an enterprise account's dedicated one.

    Every key below that takes a ``model`` takes a pool name: a worker of a dedicated pool serves
    the same model under ``model@pool``."""
    return f"{model}@{dedicated}" if dedicated else model


def job_stream(model: str, lane: Lane = Lane.STANDARD) -> str:
    return f"{PREFIX}:jobs:{{{model}}}:{lane.value}"


def worker_stream(model: str, worker_id: str) -> str:
    """Jobs routed to one worker (prefix-aware routing); only that worker reads it."""
    return f"{PREFIX}:jobs:{{{model}}}:w:{worker_id}"


def drained_key(model: str, lane: Lane) -> str:
    """How many jobs workers have taken from a lane: the gateway derives the drain rate from it."""
    return f"{PREFIX}:drained:{{{model}}}:{lane.value}"


def account_queue(model: str, lane: Lane, account_id: int | str) -> str:
    """One account's jobs waiting on a lane (a stream, oldest first, no consumer group): the claim
    script serves the lane's accounts in turn and moves each job it takes into the lane's stream."""
    return f"{PREFIX}:jobs:{{{model}}}:{lane.value}:a:{account_id}"


def lane_ring(model: str, lane: Lane) -> str:
    """The accounts with jobs waiting on a lane, in serving order (a list, each account once)."""
    return f"{PREFIX}:ring:{{{model}}}:{lane.value}"


def queued_key(model: str, lane: Lane) -> str:
    """How many jobs wait on a lane (in its accounts' queues), kept exact by the scripts that add,
    move and withdraw them: the lane's depth bound and its queue-depth gauges read it."""
    return f"{PREFIX}:queued:{{{model}}}:{lane.value}"


def wake_stream(model: str) -> str:
    """Rung (XADD) by every admission to the pool: idle workers block on it (XREAD) instead of on
    the queues themselves, which a blocking read cannot watch."""
    return f"{PREFIX}:wake:{{{model}}}"


def prefix_key(model: str, prefix_hash: str) -> str:
    """The worker that last served a prompt prefix (its KV cache likely still holds it)."""
    return f"{PREFIX}:prefix:{{{model}}}:{prefix_hash}"



def reply_stream(request_id: str) -> str:
    """One request's own reply stream: kept 24 h for replays of an idempotent request."""
    return f"{PREFIX}:reply:{request_id}"


def gateway_replies(gateway_id: str) -> str:
    """The reply stream one gateway process reads for every request it holds (entries name their
    request with the ``i`` field): one blocking read serves all of them."""
    return f"{PREFIX}:replies:{gateway_id}"


def held_units(gateway_id: str) -> str:
    return f"{PREFIX}:held:{gateway_id}"


def begun_key(request_id: str) -> str:
    """Set by the worker with a request's first reply: output went out, so a takeover must not rerun it."""
    return f"{PREFIX}:begun:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def pool_key(model: str) -> str:
    return f"{PREFIX}:pool:{{{model}}}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def worker_commands(worker_id: str) -> str:
    """Commands for one worker from its fleet supervisor (a list: RPUSH, the worker BLPOPs)."""
    return f"{PREFIX}:worker:{worker_id}:commands"


# Fleet supervisors (``flatfare fleet``) by their last heartbeat (ms): a sorted set of fleet ids.
FLEETS_KEY = f"{PREFIX}:fleets"
# A fleet's status expires on its own this long after its last heartbeat.
FLEET_TTL_S = 10


def fleet_key(fleet_id: str) -> str:
    """One fleet supervisor's :class:`FleetStatus` (JSON in a string key, expiring: FLEET_TTL_S)."""
    return f"{PREFIX}:fleet:{fleet_id}"


def model_facts_key(model: str) -> str:
    """What a model's engines took to start and wake, and its context length (a hash of
    :class:`ModelFacts`, no expiry): written by workers and fleets, read by gateways for cold models."""
    return f"{PREFIX}:facts:{{{model}}}"


# Daily quotas (flatfare.billing.quota): the counters are trusted only while the epoch marker exists;
# its value is their generation, a new one each rebuild from the ledger, which holds the lock.
QUOTA_EPOCH_KEY = f"{PREFIX}:quota:epoch"
QUOTA_REBUILD_LOCK_KEY = f"{PREFIX}:quota:rebuilding"


def quota_counter_key(account_id: int | str, day: str) -> str:
    """An account's count of requests on one quota day; with ``account_id="*"``, the SCAN pattern of
    every account's counter of that day."""
    return f"{PREFIX}:quota:{account_id}:{day}"


def key_quota_counter_key(key_id: int | str, day: str) -> str:
    """One API key's count of requests on its account's quota day (every key is counted; a key with
    its own daily cap is refused at it); with ``key_id="*"``, the SCAN pattern of that day's. Outside
    ``ff:quota:`` so the accounts' pattern never matches it."""
    return f"{PREFIX}:keyquota:{key_id}:{day}"


def inflight_key(account_id: int | str) -> str:
    """An account's requests in flight (queued or running): a sorted set of request ids scored by the
    time (ms) after which an entry left behind by a dead process no longer counts."""
    return f"{PREFIX}:inflight:a:{account_id}"


def key_inflight_key(key_id: int | str) -> str:
    """One API key's requests in flight, like :func:`inflight_key`."""
    return f"{PREFIX}:inflight:k:{key_id}"


# The gateway process that delivers the meter-event outbox to Stripe holds this lease (its id).
OUTBOX_LEADER_KEY = f"{PREFIX}:billing:outbox-leader"

# The Batch API (item 9 above): the gateway process that dispatches batch lines holds this lease (its
# id); every line's job names BATCH_REPLIES as its reply_to, which the dispatcher reads through the
# consumer group BATCH_GROUP, so replies that arrive while no dispatcher runs wait for the next one.
BATCH_LEADER_KEY = f"{PREFIX}:batches:leader"
BATCH_REPLIES = f"{PREFIX}:batches:replies"
BATCH_GROUP = "dispatcher"


def batch_request_id(batch_id: str, index: int) -> str:
    """A batch line's request id (its job's, its ledger row's): unique per batch and line."""
    return f"{batch_id}-{index}"


TOKENIZER_DIGEST = "digest"
TOKENIZER_JSON = "json"


def tokenizer_key(model: str) -> str:
    """A model's tokenizer, as its worker published it (item 7 above): one per model, whatever its pools."""
    return f"{PREFIX}:tokenizer:{{{model}}}"


def grammars_key(account_id: int) -> str:
    """The output grammars an account had compiled recently (a sorted set, by first use in ms)."""
    return f"{PREFIX}:grammars:{account_id}"


# The web console (flatfare.gateway.console). A session is stored under the SHA-256 of its cookie's
# id, so a copy of Redis gives no usable session; the rate-limit counters are per window.
def console_session_key(session_hash: str) -> str:
    """A console session (a hash: who is logged in, their CSRF token), expiring on its own."""
    return f"{PREFIX}:console:session:{session_hash}"


def console_user_sessions_key(user_id: int | str) -> str:
    """The hashes of a console user's live sessions (a set), so a password change can end them all."""
    return f"{PREFIX}:console:user-sessions:{user_id}"


def console_attempts_key(kind: str, subject: str) -> str:
    """Failed console logins (or sign-ups, resets) of one ``kind`` ("account", "address") for one
    subject (a SHA-256 of the email, the client address) in the current window: a counter."""
    return f"{PREFIX}:console:attempts:{kind}:{subject}"


def console_form_key(session_hash: str, nonce: str) -> str:
    """A key-issuing console form already submitted (its one-time nonce, per session): a browser's
    re-post on refresh finds it and issues no second key."""
    return f"{PREFIX}:console:form:{session_hash}:{nonce}"


def console_token_key(purpose: str, token_hash: str) -> str:
    """A one-time emailed token (``purpose`` "reset" or "verify") under its SHA-256: the user id."""
    return f"{PREFIX}:console:token:{purpose}:{token_hash}"


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
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(int(f.get("max_model_len", "0")), float(f.get("start_s", "0")), float(f.get("wake_s", "0")))


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


def _text(value: bytes | str) -> str:
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

    @property
    def priority(self) -> int:
        return self.lane.priority

    @property
    def reply_key(self) -> str:
        return self.reply_to or reply_stream(self.request_id)

    def to_fields(self) -> dict[str, str]:
        return {
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

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> Job:
        f = {_text(k): _text(v) for k, v in fields.items()}
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
        f = {_text(k): _text(v) for k, v in fields.items()}
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
