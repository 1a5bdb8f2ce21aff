"""The gateway's side of the reply contract: one reader per process for every request it holds.

Workers write each reply to the job's ``reply_to`` stream. For ordinary requests that is this
process's own stream, ``contract.gateway_replies(gateway_id)``: one task (:class:`ReplyRouter`)
reads it with one blocking XREAD and hands each entry to the :class:`Inbox` of its request, so a
process holding a thousand requests makes one read per batch of replies, not one blocking read per
request. Idempotent requests (and their replays) use the request's own stream, kept 24 h; a small
pump task per such request feeds its inbox the same way. (Jobs are put on their lanes by
:mod:`gateway.queueing`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from flatfare import contract
from flatfare.contract import Reply
from flatfare.redis_conn import SOCKET_TIMEOUT_S, without_read_timeouts
from gateway.errors import APIError

log = logging.getLogger("flatfare.gateway")

# How long one blocking read waits before it renews the stream's TTL and trims it.
_BLOCK_MS = 1_000
# Most entries one read returns.
_READ_COUNT = 4096
# Read entries are trimmed once this many have piled up (or at the TTL's renewal).
_TRIM_EVERY = 512
# How often the stream's TTL is renewed (it expires REPLY_TTL_S after its process stops renewing).
_RENEW_EVERY_S = 5.0
# Pause after a failed read (Redis restarting), so the loop does not spin.
_RETRY_S = 0.2


def timed_out() -> APIError:
    return APIError(504, "The request timed out waiting for its worker; retry it.", code="timeout")


class Inbox:
    """The replies of one request, as the reader delivers them, and a way to wait for them."""

    __slots__ = ("request_id", "_replies", "_waiter", "gone")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._replies: list[Reply] = []
        self._waiter: asyncio.Future[None] | None = None
        # Set when the client disconnected; wakes whoever waits.
        self.gone = False

    def push(self, reply: Reply) -> None:
        self._replies.append(reply)
        self._wake()

    def leave(self) -> None:
        """The client went away."""
        self.gone = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self, timeout: float | None) -> list[Reply]:
        """The replies that arrived since the last call, in order; empty if ``timeout`` seconds passed
        (or the client left) first."""
        if not self._replies and not self.gone:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        batch, self._replies = self._replies, []
        return batch


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ReplyRouter:
    """Reads this gateway process's reply stream and routes each entry to its request's inbox."""

    def __init__(self, redis: aioredis.Redis, timeout_s: float, gateway_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        # One pipeline a read, bounded as a whole (redis-py would time each of its replies).
        self._reader = without_read_timeouts(redis)
        self.timeout_s = timeout_s
        self.gateway_id = gateway_id or uuid.uuid4().hex[:16]
        self.stream = contract.gateway_replies(self.gateway_id)
        self._inboxes: dict[str, Inbox] = {}
        self._pumps: dict[int, asyncio.Task[None]] = {}  # id(inbox) -> its pump
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name="reply-router")

    async def stop(self) -> None:
        for task in [self._task, *self._pumps.values()]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._pumps.values()] if t is not None),
                             return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self.stream)
        await self._reader.aclose()

    # -- per request -------------------------------------------------------------------------

    def open(self, request_id: str) -> Inbox:
        """The inbox of a request whose replies come to this process's stream. Open it before the
        job is queued, so no reply can arrive unrouted."""
        inbox = self._inboxes[request_id] = Inbox(request_id)
        return inbox

    def follow(self, request_id: str) -> Inbox:
        """The inbox of a request with its own reply stream (idempotent, or a replay of one)."""
        inbox = Inbox(request_id)
        key = id(inbox)
        task = asyncio.create_task(self._pump(contract.reply_stream(request_id), inbox), name=f"replay-{request_id}")
        self._pumps[key] = task
        task.add_done_callback(lambda _t: self._pumps.pop(key, None))
        return inbox

    def close(self, inbox: Inbox) -> None:
        """The request is over: stop routing to its inbox."""
        pump = self._pumps.pop(id(inbox), None)
        if pump is not None:
            pump.cancel()
        elif self._inboxes.get(inbox.request_id) is inbox:
            del self._inboxes[inbox.request_id]

    @property
    def holding(self) -> int:
        return len(self._inboxes)

    # -- the readers -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        last = "0-0"
        unread_trimmed = 0  # entries read since the stream was last trimmed
        renew_at = 0.0  # when the stream's TTL is renewed next
        while True:
            now = self._clock()
            trim = last != "0-0" and (unread_trimmed >= _TRIM_EVERY or now >= renew_at)
            renew = now >= renew_at
            try:
                async with asyncio.timeout(SOCKET_TIMEOUT_S):
                    if trim or renew:
                        async with self._reader.pipeline(transaction=False) as pipe:
                            if trim:  # everything before the last entry read
                                pipe.xtrim(self.stream, minid=last, approximate=False)
                            if renew:
                                pipe.expire(self.stream, contract.REPLY_TTL_S)
                            pipe.xread({self.stream: last}, count=_READ_COUNT, block=_BLOCK_MS)
                            result = (await pipe.execute())[-1]
                    else:  # one command: at one request in flight, a read per reply
                        result = await self._reader.xread({self.stream: last}, count=_READ_COUNT, block=_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("reading replies failed (%s); retrying", exc.__class__.__name__)
                await asyncio.sleep(_RETRY_S)
                continue
            if trim:
                unread_trimmed = 0
            if renew:
                renew_at = now + _RENEW_EVERY_S
            inboxes = self._inboxes
            for _stream, entries in result or ():
                unread_trimmed += len(entries)
                for entry_id, fields in entries:
                    last = entry_id
                    request_id = fields.get(b"i")
                    inbox = inboxes.get(request_id.decode()) if request_id else None
                    if inbox is not None:
                        inbox.push(Reply.from_entry(fields))

    async def _pump(self, key: str, inbox: Inbox) -> None:
        last = "0-0"
        while True:
            try:
                result = await self._redis.xread({key: last}, count=256, block=_BLOCK_MS)
            except (RedisError, OSError):
                await asyncio.sleep(_RETRY_S)
                continue
            for _stream, entries in result or ():
                for entry_id, fields in entries:
                    last = entry_id
                    reply = Reply.from_entry(fields)
                    inbox.push(reply)
                    if reply.kind.terminal:
                        return


class Replies:
    """What the completion service does with replies: cancel a request, tidy its own stream."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def cancel(self, request_id: str) -> None:
        """Tell the pool the client went away: a queued job is skipped, a running one aborted."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(contract.cancel_key(request_id), 1, ex=contract.CANCEL_TTL_S)
            pipe.publish(contract.CANCEL_CHANNEL, request_id)
            await pipe.execute()

    async def keep(self, request_id: str, keep_s: int) -> None:
        """Keep an idempotent request's own reply stream ``keep_s`` seconds, for replays."""
        await self._redis.expire(contract.reply_stream(request_id), keep_s)

    async def has_replies(self, request_id: str) -> bool:
        return bool(await self._redis.exists(contract.reply_stream(request_id)))
