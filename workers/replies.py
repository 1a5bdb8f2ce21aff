"""Writing replies to Redis in batches: one pipeline per event-loop turn for every job of the worker.

A worker streams thousands of chunks a second; a round trip (and a redis-py pipeline) per chunk
would spend the event loop that vLLM's own output handling runs on. Chunks are queued without
waiting; the writer task sends everything queued in one pipeline, in order, so each reply stream
keeps its order. A terminal reply is awaited: when it returns, it and every chunk before it are in
Redis, and only then is the job acknowledged, through the same batches (the jobs that end in one
loop turn share one round trip for their acknowledgements too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Reply

log = logging.getLogger("flatfare.worker")

# (key, reply fields, set the reply TTL, done) for a reply; (stream, None, False, done) plus the
# entry id in place of the fields for an acknowledgement.
_Pending = tuple[str, dict[str, str] | bytes, bool, asyncio.Future[None] | None]


class ReplyWriter:
    def __init__(self, redis: aioredis.Redis) -> None:
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

    def send(self, key: str, reply: Reply, *, set_ttl: bool = False) -> None:
        """Queue a reply; it reaches Redis with the next batch."""
        self._pending.append((key, reply.to_fields(), set_ttl, None))
        self._wake.set()

    async def send_and_wait(self, key: str, reply: Reply, *, set_ttl: bool = True) -> None:
        """Queue a reply and return once it (and everything queued before it) is in Redis."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((key, reply.to_fields(), set_ttl, done))
        self._wake.set()
        await done

    async def ack(self, stream: str, entry_id: bytes) -> None:
        """Acknowledge and delete a finished job's entry; returns once that is done in Redis."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((stream, entry_id, False, done))
        self._wake.set()
        await done

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, fields, set_ttl, _ in batch:
                        if isinstance(fields, bytes):  # an acknowledgement
                            pipe.xack(key, contract.POOL_GROUP, fields)
                            pipe.xdel(key, fields)
                            continue
                        pipe.xadd(key, fields)
                        if set_ttl:
                            pipe.expire(key, contract.REPLY_TTL_S)
                    await pipe.execute()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("writing %d replies and acknowledgements failed: %s", len(batch), exc)
                for *_, done in batch:
                    if done is not None and not done.done():
                        done.set_exception(exc)
                continue
            for *_, done in batch:
                if done is not None and not done.done():
                    done.set_result(None)
