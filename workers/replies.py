"""Writing replies to Redis in batches: one pipeline per event-loop turn for every job of the worker.

A worker streams thousands of chunks a second; a round trip (and a redis-py pipeline) per chunk
would spend the event loop that vLLM's own output handling runs on. Chunks are queued without
waiting; the writer task sends everything queued in one pipeline, in order, so each reply stream
keeps its order. A terminal reply is awaited: when it returns, it and every chunk before it are in
Redis, and only then is the job acknowledged, through the same batches (the jobs that end in one
loop turn share one round trip for their acknowledgements too).

A batch that fails (Redis restarting, a network blip) is sent again, ahead of anything newer, until
it goes through or :data:`GIVE_UP_S` passes: dropping it would leave a hole in a stream that still
ends normally, an answer missing words with nothing to say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Job, Reply, ReplyKind
from flatfare.redis_conn import REDIS_DOWN, SOCKET_TIMEOUT_S

log = logging.getLogger("flatfare.worker")

# How long a failing batch is retried before its waiters hear of the failure (and it is dropped).
GIVE_UP_S = 30.0
RETRY_EVERY_S = 0.2

# (key, reply fields, set the reply TTL, the request's begun marker to set or "", done) for a reply;
# (stream, entry id, False, the begun marker to delete or "", done) for an acknowledgement;
# (key, amount, False, "", None) for a counter; (in-flight set, request id, False, "", None) for the end
# of a request's time in flight.
_Pending = tuple[str, dict[str, str] | bytes | int | str, bool, str, asyncio.Future[None] | None]


class ReplyWriter:
    def __init__(self, redis: aioredis.Redis) -> None:
        # A client without redis-py's per-read timers (flatfare.redis_conn.without_read_timeouts):
        # one timeout bounds each pipeline instead.
        self._redis = redis
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-writer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def send(self, job: Job, reply: Reply, *, first: bool = False) -> None:
        """Queue a chunk for ``job``'s reply stream; it reaches Redis with the next batch. The first
        chunk also sets the stream's TTL and the request's begun marker (output went out: a takeover
        must fail the request, not run it again)."""
        self._pending.append(_entry(job, reply, first, None))
        self._wake.set()

    async def send_and_wait(self, job: Job, reply: Reply) -> None:
        """Queue a terminal reply and return once it (and everything queued before it) is in Redis.
        The request leaves its account's and key's in-flight sets in the same batch, before the
        reply: a client that sends its next request on reading this one's answer finds the slot free."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending += [(key, job.request_id, False, "", None) for key in job.inflight_keys()]
        self._pending.append(_entry(job, reply, True, done))
        self._wake.set()
        await done

    def count(self, key: str, amount: int) -> None:
        """Add ``amount`` to a counter with the next batch (a lane's drained jobs), without waiting."""
        self._pending.append((key, amount, False, "", None))
        self._wake.set()

    async def ack(self, stream: str, entry_id: bytes, request_id: str = "") -> None:
        """Acknowledge and delete a finished job's entry (and the request's begun marker); returns
        once that is done in Redis."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((stream, entry_id, False, contract.begun_key(request_id) if request_id else "", done))
        self._wake.set()
        await done

    async def _run(self) -> None:
        failing_since = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                async with asyncio.timeout(SOCKET_TIMEOUT_S), self._redis.pipeline(transaction=False) as pipe:
                    for key, fields, set_ttl, begun, _ in batch:
                        if isinstance(fields, int):  # a counter
                            pipe.incrby(key, fields)
                            continue
                        if isinstance(fields, str):  # out of an in-flight set
                            pipe.zrem(key, fields)
                            continue
                        if isinstance(fields, bytes):  # an acknowledgement
                            pipe.xack(key, contract.POOL_GROUP, fields)
                            pipe.xdel(key, fields)
                            if begun:
                                pipe.delete(begun)
                            continue
                        pipe.xadd(key, fields)
                        if set_ttl:
                            pipe.expire(key, contract.REPLY_TTL_S)
                        if begun:
                            pipe.set(begun, 1, ex=contract.REPLY_TTL_S)
                    await pipe.execute()
            except REDIS_DOWN as exc:
                now = asyncio.get_running_loop().time()
                failing_since = failing_since or now
                if now - failing_since < GIVE_UP_S:
                    log.warning("writing %d replies and acknowledgements failed (%s); retrying", len(batch), exc)
                    self._pending[:0] = batch  # first again, so every stream keeps its order
                    await asyncio.sleep(RETRY_EVERY_S)
                    self._wake.set()
                    continue
                log.error("writing %d replies and acknowledgements failed for %.0f s: %s", len(batch),
                          now - failing_since, exc)
                failing_since = 0.0
                for *_, done in batch:
                    if done is not None and not done.done():
                        done.set_exception(exc)
                continue
            failing_since = 0.0
            for *_, done in batch:
                if done is not None and not done.done():
                    done.set_result(None)


def _entry(job: Job, reply: Reply, set_ttl: bool, done: asyncio.Future[None] | None) -> _Pending:
    # A gateway's shared reply stream needs the request id in each entry; a request's own does not.
    fields = reply.to_fields(job.request_id if job.reply_to else "")
    marker = contract.begun_key(job.request_id) if set_ttl and reply.kind is ReplyKind.CHUNK else ""
    return (job.reply_key, fields, set_ttl, marker, done)


class BatchedGet:
    """GETs of many jobs started in one event-loop turn, sent as one MGET: a claim of 64 jobs costs
    one round trip for their cancellation checks, not 64."""

    def __init__(self, redis: aioredis.Redis) -> None:
        # A client without redis-py's per-send and per-read timers (wait_for on every send: visible
        # in the worker's GPU profile); one timeout bounds each MGET instead.
        self._redis = redis
        self._keys: list[str] = []
        self._waiters: list[tuple[int, int, asyncio.Future[list[bytes | None]]]] = []

    async def get(self, keys: list[str]) -> list[bytes | None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[bytes | None]] = loop.create_future()
        if not self._waiters:
            loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        self._waiters.append((len(self._keys), len(keys), done))
        self._keys += keys
        return await done

    async def _flush(self) -> None:
        keys, waiters = self._keys, self._waiters
        self._keys, self._waiters = [], []
        try:
            async with asyncio.timeout(SOCKET_TIMEOUT_S):
                values = await self._redis.mget(keys)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            for *_, done in waiters:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, Exception) else aioredis.RedisError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for start, count, done in waiters:
            if not done.done():
                done.set_result(values[start:start + count])
