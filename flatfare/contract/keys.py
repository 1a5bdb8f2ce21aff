"""Every Redis key of the platform's subsystems but the console's, by the concept that owns it: the lane
queue's (jobs, rings, counters, the wake stream), replies and cancellations, workers and fleets, daily
quotas and requests in flight, the billing outbox's and the batch dispatcher's leases, tokenizers and
grammars. Each takes its pool's hash tag (``{pool}``) where a script touches several keys of a pool.
Imports nothing of ours."""

from __future__ import annotations

PREFIX = "ff"
POOL_GROUP = "pool"
CANCEL_CHANNEL = f"{PREFIX}:cancel"
POOLS_KEY = f"{PREFIX}:pools"
# Gateway processes by their last sign of life (ms): a sorted set.
GATEWAYS_KEY = f"{PREFIX}:gateways"


def pool_name(model: str, dedicated: str | None = None) -> str:
    """The pool serving ``model``: the shared one, or an enterprise account's dedicated one.

    Every key below that takes a ``model`` takes a pool name: a worker of a dedicated pool serves
    the same model under ``model@pool``."""
    return f"{model}@{dedicated}" if dedicated else model


def job_stream(model: str, lane: str = "standard") -> str:
    """A lane's stream (a :class:`~flatfare.contract.jobs.Lane`), read by the pool's workers through
    :data:`POOL_GROUP`: a job taken is pending there, under the worker's lease."""
    return f"{PREFIX}:jobs:{{{model}}}:{lane}"


def worker_stream(model: str, worker_id: str) -> str:
    """Jobs routed to one worker (prefix-aware routing); only that worker reads it."""
    return f"{PREFIX}:jobs:{{{model}}}:w:{worker_id}"


def drained_key(model: str, lane: str) -> str:
    """How many jobs workers have taken from a lane: the gateway derives the drain rate from it."""
    return f"{PREFIX}:drained:{{{model}}}:{lane}"


def account_queue(model: str, lane: str, account_id: int | str) -> str:
    """One account's jobs waiting on a lane (a stream, oldest first, no consumer group): the claim
    script serves the lane's accounts in turn and moves each job it takes into the lane's stream."""
    return f"{PREFIX}:jobs:{{{model}}}:{lane}:a:{account_id}"


def lane_ring(model: str, lane: str) -> str:
    """The accounts with jobs waiting on a lane, in serving order (a list, each account once)."""
    return f"{PREFIX}:ring:{{{model}}}:{lane}"


def queued_key(model: str, lane: str) -> str:
    """How many jobs wait on a lane (in its accounts' queues), kept exact by the scripts that add,
    move and withdraw them: the lane's depth bound and its queue-depth gauges read it."""
    return f"{PREFIX}:queued:{{{model}}}:{lane}"


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

# The gateway process that finds crossed quota-alert thresholds and sends the alerts holds this lease.
QUOTA_ALERTS_LEADER_KEY = f"{PREFIX}:quota-alerts:leader"

# The Batch API (item 9 above): the gateway process that dispatches batch lines holds this lease (its
# id); every line's job names BATCH_REPLIES as its reply_to, which the dispatcher reads through the
# consumer group BATCH_GROUP, so replies that arrive while no dispatcher runs wait for the next one.
BATCH_LEADER_KEY = f"{PREFIX}:batches:leader"
BATCH_REPLIES = f"{PREFIX}:batches:replies"
BATCH_GROUP = "dispatcher"


def batch_request_id(batch_id: str, index: int) -> str:
    """A batch line's request id (its job's, its ledger row's): unique per batch and line."""
    return f"{batch_id}-{index}"


def batch_trace_key(batch_id: str) -> str:
    """The W3C traceparent of the request that created a batch (a string, expiring after its window):
    each of its lines' jobs runs under a span of its own in that trace. Gone (Redis lost it): a new trace
    a line."""
    return f"{PREFIX}:batches:trace:{batch_id}"


TOKENIZER_DIGEST = "digest"
TOKENIZER_JSON = "json"


def tokenizer_key(model: str) -> str:
    """A model's tokenizer, as its worker published it (item 7 above): one per model, whatever its pools."""
    return f"{PREFIX}:tokenizer:{{{model}}}"


def grammars_key(account_id: int) -> str:
    """The output grammars an account had compiled recently (a sorted set, by first use in ms)."""
    return f"{PREFIX}:grammars:{account_id}"




# Shared-key detection (flatfare.gateway.shared_keys): what the admission script records of each API key's
# clients. Addresses and user agents only as keyed hashes (the secret below, or the gateway's setting).
KEY_SIGHTINGS_SECRET_KEY = f"{PREFIX}:keyseen:secret"


def key_addresses_key(key_id: int | str, day: str) -> str:
    """The distinct client addresses one API key was used from on a UTC day (a HyperLogLog of their
    keyed hashes, kept the configured days)."""
    return f"{PREFIX}:keyseen:a:{key_id}:{day}"


def key_agents_key(key_id: int | str, day: str) -> str:
    """The distinct user agents one API key was used with on a UTC day (a HyperLogLog, like the addresses)."""
    return f"{PREFIX}:keyseen:u:{key_id}:{day}"


def key_recent_addresses_key(key_id: int | str) -> str:
    """The addresses one API key was used from lately (a sorted set of hashes by last use, ms): kept only
    for a plan that refuses a key used from too many addresses at once, and trimmed to its window."""
    return f"{PREFIX}:keyseen:r:{key_id}"


def shared_keys_key(day: str) -> str:
    """The API keys used from more addresses on a UTC day than their plan's alert threshold (a set of ids)."""
    return f"{PREFIX}:keyseen:shared:{day}"


def shared_key_told_key(key_id: int | str, day: str) -> str:
    """Set (NX) by the gateway process that emails a shared key's owner: once per key and day."""
    return f"{PREFIX}:keyseen:told:{key_id}:{day}"
