"""Quota units held by gateway processes, and the reaper that settles those of a process that died.

The admission script holds each unit it counts in the process's hash (``contract.held_units``). A
request that ends free gives its unit back (the quota's give-back script, which un-holds it in the
same step); a billable one only releases it, and releases are batched: one HDEL for every request
settled in the last half second. So a process that dies leaves behind exactly the units of the
requests it had not settled, wherever they were: admitted but without a ledger row yet, waiting for
a worker, or streaming.

Every process renews its score in ``contract.GATEWAYS_KEY``. The reaper (every live process runs
one; a lock per dead process makes one of them do the work) takes a process silent for
``dead_after_s``: it closes that process's open ledger rows as failed and free
(``gateway_lost``), gives back every unit whose request is not billable (or has no row at all),
cancels their jobs, takes its requests out of their accounts' and keys' in-flight sets, and forgets
the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis

from flatfare.billing.ledger import Ledger
from flatfare.billing.quota import DailyQuota, QuotaUnavailable, parse_held
from flatfare import contract
from flatfare.contract.timing import GATEWAY_BEAT_S
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN

log = logging.getLogger("flatfare.gateway")

# Releases are flushed, and the process's sign of life renewed, this often.
FLUSH_EVERY_S = GATEWAY_BEAT_S
REAP_EVERY_S = 5.0
LOST_CODE = "gateway_lost"


class HeldUnits:
    """This process's side: batched releases, its sign of life, and the reaper's passes."""

    def __init__(self, redis: aioredis.Redis, gateway_id: str, ledger: Ledger, quota: DailyQuota,
                 dead_after_s: float, on_lost: Callable[[int], None] | None = None) -> None:
        self._redis = redis
        # Told how many requests of a dead process the reaper closed as lost (the gateway's metrics).
        self._on_lost = on_lost
        self.gateway_id = gateway_id
        self.key = contract.held_units(gateway_id)
        self._ledger = ledger
        self._quota = quota
        self._dead_after_ms = int(dead_after_s * 1000)
        self._released: list[str] = []
        self._ended: list[tuple[str, str]] = []  # (in-flight set, request id) to take out
        self._owed: list[tuple[int, str, str, str, int | None]] = []  # give-backs that found Redis away
        self._task: asyncio.Task[None] | None = None

    def release(self, request_id: str) -> None:
        """The request was charged: its unit stays counted and is no longer this process's to settle."""
        self._released.append(request_id)

    def ended(self, request_id: str, account_id: int, key_id: int | None) -> None:
        """The request is no longer in flight (its worker says so with its terminal reply; this covers
        the requests that end without one: cancelled, timed out, withdrawn). Sent with the next
        flush."""
        self._ended.append((contract.inflight_key(account_id), request_id))
        if key_id is not None:
            self._ended.append((contract.key_inflight_key(key_id), request_id))

    def give_back_later(self, account_id: int, day: str, request_id: str, generation: str,
                        key_id: int | None = None) -> None:
        """A give-back that failed (Redis unreachable): tried again with every pass until it is done.
        ``generation`` '': an admission whose answer was lost (Redis went away during the call), so
        whether it counted, held and queued the request is unknown; its job is cancelled and its unit
        given back if it is held. ``key_id``: the key whose counter the unit counted too."""
        self._owed.append((account_id, day, request_id, generation, key_id))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="held-units")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(*REDIS_DOWN):
            await self._flush()
            if not await self._redis.hlen(self.key):  # nothing left to settle: forget this process now
                await self._redis.zrem(contract.GATEWAYS_KEY, self.gateway_id)

    async def _flush(self) -> None:
        released, self._released = self._released, []
        ended, self._ended = self._ended, []
        async with self._redis.pipeline(transaction=False) as pipe:
            if released:
                pipe.hdel(self.key, *released)
            for key, request_id in ended:
                pipe.zrem(key, request_id)
            pipe.zadd(contract.GATEWAYS_KEY, {self.gateway_id: int(time.time() * 1000)})
            try:
                await pipe.execute()
            except BaseException:
                self._released[:0] = released  # tried again at the next pass
                self._ended[:0] = ended
                raise

    async def _run(self) -> None:
        reap_at = time.monotonic() + REAP_EVERY_S
        while True:
            try:
                await self._flush()
                while self._owed:
                    account_id, day, request_id, generation, key_id = self._owed[0]
                    if not generation:
                        await self._redis.set(contract.cancel_key(request_id), 1, ex=contract.CANCEL_TTL_S)
                    await self._quota.give_back(account_id, day, request_id, self.key, generation, key_id)
                    self._owed.pop(0)
                if time.monotonic() >= reap_at:
                    reap_at = time.monotonic() + REAP_EVERY_S
                    await self.reap()
            except asyncio.CancelledError:
                raise
            except (*REDIS_DOWN, *DATABASE_DOWN, QuotaUnavailable) as exc:
                log.warning("held units: %s (%s); retrying", exc.__class__.__name__, exc)
            await asyncio.sleep(FLUSH_EVERY_S)

    async def reap(self) -> int:
        """Settle what dead gateway processes held; returns how many units were given back."""
        silent_since = int(time.time() * 1000) - self._dead_after_ms
        given_back = 0
        for raw in await self._redis.zrangebyscore(contract.GATEWAYS_KEY, 0, silent_since):
            gateway_id = raw.decode()
            if gateway_id == self.gateway_id:
                continue
            lock = f"{contract.held_units(gateway_id)}:reaping"
            if not await self._redis.set(lock, uuid.uuid4().hex, nx=True, ex=60):
                continue  # another process is at it
            try:
                given_back += await self._settle_dead(gateway_id)
            finally:
                await self._redis.delete(lock)
        return given_back

    async def _settle_dead(self, gateway_id: str) -> int:
        key = contract.held_units(gateway_id)
        held = {rid.decode(): value.decode() for rid, value in (await self._redis.hgetall(key)).items()}
        given_back = 0
        if held:
            billable = await self._ledger.abandon(list(held), LOST_CODE)
            if self._on_lost is not None:
                self._on_lost(billable.closed)
            free = [rid for rid in held if not billable.get(rid, False)]
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id in free:  # a job still queued or running for nobody
                    pipe.set(contract.cancel_key(request_id), 1, ex=contract.CANCEL_TTL_S)
                for request_id, value in held.items():  # nobody waits for any of them now
                    account_id, _day, key_id = parse_held(value)
                    pipe.zrem(contract.inflight_key(account_id), request_id)
                    if key_id is not None:
                        pipe.zrem(contract.key_inflight_key(key_id), request_id)
                if len(free) < len(held):
                    pipe.hdel(key, *(rid for rid in held if billable.get(rid, False)))
                await pipe.execute()
            for request_id in free:
                account_id, day, key_id = parse_held(held[request_id])
                given_back += await self._quota.give_back(account_id, day, request_id, key, "", key_id)
            log.warning("gateway %s died holding %d units: %d given back, %d charged", gateway_id, len(held),
                        given_back, len(held) - len(free))
        if not await self._redis.hlen(key):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zrem(contract.GATEWAYS_KEY, gateway_id)
                pipe.delete(key, contract.gateway_replies(gateway_id))
                await pipe.execute()
        return given_back
