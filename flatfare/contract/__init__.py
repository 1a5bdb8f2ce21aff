"""The contract between gateway, workers and fleets, by concept: :mod:`.keys` (every Redis key but the
console's, which are the console's own), :mod:`.jobs` (the job kinds, lanes, the job and reply
formats, the error envelope), :mod:`.control` (heartbeats, a fleet's status and commands, model
facts) and :mod:`.timing` (the times the processes keep and the rules between them, checked in code).
Every side imports this package and nothing else of the others; it imports nothing of ours. Its
names are all here as well, so ``contract.job_stream(...)`` reads as before. The lane queue's scripts
over these keys are :mod:`flatfare.lanes`.

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
   :data:`POOL_GROUP`: a job taken is pending there, under the worker's lease (the scripts:
   :mod:`flatfare.lanes`).
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

from flatfare.contract.control import Command, CommandKind, FleetStatus, ModelFacts, WorkerInfo, WorkerState
from flatfare.contract.jobs import (ENDPOINT_PATHS, LIVE_LANES, STANDARD_SHARE, Endpoint, Job, Lane, Reply, ReplyKind,
                                    Usage, error_body)
from flatfare.contract.keys import (BATCH_GROUP, BATCH_LEADER_KEY, BATCH_REPLIES, CANCEL_CHANNEL, FLEETS_KEY,
                                    GATEWAYS_KEY, OUTBOX_LEADER_KEY, POOL_GROUP, POOLS_KEY, PREFIX, QUOTA_EPOCH_KEY,
                                    QUOTA_REBUILD_LOCK_KEY, TOKENIZER_DIGEST, TOKENIZER_JSON, account_queue,
                                    batch_request_id, batch_trace_key, begun_key, cancel_key, drained_key, fleet_key,
                                    gateway_replies, grammars_key, held_units, inflight_key, job_stream,
                                    key_inflight_key, key_quota_counter_key, lane_ring, model_facts_key, pool_key,
                                    pool_name, prefix_key, queued_key, quota_counter_key, reply_stream, tokenizer_key,
                                    wake_stream, worker_commands, worker_key, worker_stream)
from flatfare.contract.keys import (KEY_SIGHTINGS_SECRET_KEY, key_addresses_key, key_agents_key,
                                    key_recent_addresses_key, shared_key_told_key, shared_keys_key)
from flatfare.contract.timing import (CANCEL_TTL_S, DEFAULT_LEASE_S, FLEET_TTL_S, HEARTBEAT_INTERVAL_S, HELD_EVERY_S,
                                      REPLY_TTL_S, WORKER_TTL_S)

__all__ = [
    "ENDPOINT_PATHS", "LIVE_LANES", "STANDARD_SHARE", "Endpoint", "Job", "Lane", "Reply", "ReplyKind", "Usage",
    "error_body",
    "Command", "CommandKind", "FleetStatus", "ModelFacts", "WorkerInfo", "WorkerState",
    "BATCH_GROUP", "BATCH_LEADER_KEY", "BATCH_REPLIES", "CANCEL_CHANNEL", "FLEETS_KEY", "GATEWAYS_KEY",
    "OUTBOX_LEADER_KEY", "POOL_GROUP", "POOLS_KEY", "PREFIX", "QUOTA_EPOCH_KEY", "QUOTA_REBUILD_LOCK_KEY",
    "TOKENIZER_DIGEST", "TOKENIZER_JSON", "account_queue", "batch_request_id", "batch_trace_key", "begun_key",
    "cancel_key", "drained_key", "fleet_key", "gateway_replies", "grammars_key", "held_units", "inflight_key",
    "job_stream", "key_inflight_key", "key_quota_counter_key", "lane_ring", "model_facts_key", "pool_key", "pool_name",
    "prefix_key", "queued_key", "quota_counter_key", "reply_stream", "tokenizer_key", "wake_stream", "worker_commands",
    "worker_key", "worker_stream",
    "KEY_SIGHTINGS_SECRET_KEY", "key_addresses_key", "key_agents_key", "key_recent_addresses_key",
    "shared_key_told_key", "shared_keys_key",
    "CANCEL_TTL_S", "DEFAULT_LEASE_S", "FLEET_TTL_S", "HEARTBEAT_INTERVAL_S", "HELD_EVERY_S", "REPLY_TTL_S",
    "WORKER_TTL_S",
]
