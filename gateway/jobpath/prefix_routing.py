"""Prefix-aware routing: send requests that share a long prompt prefix to the worker that served it
recently, so vLLM's prefix cache hits; fall back to the shared lane when that worker is busy (full,
or holding ``BUSY_MARGIN`` more jobs than the least-loaded worker of the pool).

The prefix is what requests of one application share: every chat message but the last (system
prompt, documents, earlier turns), or the head of a completion prompt. Only prefixes of at least
``MIN_PREFIX_CHARS`` are routed: short ones cost little to prefill anyway.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Endpoint, WorkerInfo

MIN_PREFIX_CHARS = 512
COMPLETION_PREFIX_CHARS = 2048
# The owner of a prefix is "busy" when it holds this many more jobs than the least-loaded worker:
# a cache hit is not worth queueing behind a hot spot (capacity alone says little on CPUs, whose
# engines accept many sequences but run them slowly).
BUSY_MARGIN = 2


def prefix_hash(endpoint: Endpoint, body: dict[str, Any]) -> str:
    """A hash of the request's long shared prefix, or "" when it has none worth routing on."""
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages") or []
        shared = orjson.dumps(messages[:-1]) if len(messages) > 1 else b""
    else:
        prompt = body.get("prompt")
        shared = prompt[:COMPLETION_PREFIX_CHARS].encode() if isinstance(prompt, str) else b""
    if len(shared) < MIN_PREFIX_CHARS:
        return ""
    return hashlib.blake2b(shared, digest_size=12).hexdigest()


class PrefixRouter:
    def __init__(self, redis: aioredis.Redis, enabled: bool) -> None:
        self._redis = redis
        self.enabled = enabled

    async def target(self, model: str, prefix: str, workers: tuple[WorkerInfo, ...]) -> str | None:
        """The stream of the worker that last served ``prefix``, if it is live and not busy."""
        if not self.enabled or not prefix or not workers:
            return None
        owner = await self._redis.get(contract.prefix_key(model, prefix))
        if owner is None:
            return None
        owner_id = owner.decode()
        least_loaded = min(w.inflight for w in workers)
        for worker in workers:
            if worker.worker_id == owner_id and worker.free > 0 and worker.inflight <= least_loaded + BUSY_MARGIN:
                return contract.worker_stream(model, owner_id)
        return None
