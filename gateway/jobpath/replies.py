"""The gateway's side of the reply contract: one reader per process for every request it holds.

Workers write each reply to the job's ``reply_to`` stream. For ordinary requests that is this
process's own stream, ``contract.gateway_replies(gateway_id)``: one task (:class:`ReplyRouter`)
reads it with one blocking XREAD and hands each entry to the :class:`Inbox` of its request, so a
process holding a thousand requests makes one read per batch of replies, not one blocking read per
request. Idempotent requests (and their replays) use the request's own stream, kept 24 h; a small
pump task per such request feeds its inbox the same way. (Jobs are put on their lanes by
:mod:`flatfare.gateway.jobpath.queueing`.)

A Redis that lost its data lost the jobs still queued in it. The reader notices (the quota
counters' generation, read every second and returned by each admission, changed) and from then on
watches every request it holds: one that hears nothing for ``lost_after_s``, not even a worker's
HELD reply, and that is no longer in its account's in-flight set, is answered 503 ``job_lost`` (free) instead of waiting
for its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis

import orjson

from flatfare import contract
from flatfare.contract import Reply, ReplyKind
from flatfare.contract.timing import REPLY_RENEW_EVERY_S
from flatfare.redis_conn import REDIS_DOWN, SOCKET_TIMEOUT_S, without_read_timeouts
from flatfare.gateway.errors import APIError, error_body

log = logging.getLogger("flatfare.gateway")

# How long one blocking read waits before it renews the stream's TTL and trims it.
_BLOCK_MS = 1_000
# Most entries one read returns.
_READ_COUNT = 4096
# Read entries are trimmed once this many have piled up (or at the TTL's renewal).
_TRIM_EVERY = 512
# The stream's TTL is renewed every contract.timing.REPLY_RENEW_EVERY_S (it expires REPLY_TTL_S after its
# process stops renewing).
# Pause after a failed read (Redis restarting), so the loop does not spin.
_RETRY_S = 0.2
# How often the quota counters' generation is read (a change means Redis lost its data), and how
# often the requests watched since are looked at.
_CHECK_EVERY_S = 1.0
JOB_LOST = "job_lost"


def timed_out() -> APIError:
    return APIError(504, "The request timed out waiting for its worker; retry it.", code="timeout")


def _job_lost() -> Reply:
    body = error_body(503, "The request's job was lost when the queue's store lost its data; it was not "
                      "charged. Retry it.", code=JOB_LOST)
    return Reply(ReplyKind.ERROR, orjson.dumps(body).decode(), status=503)


class Inbox:
    """The replies of one request, as the reader delivers them, and a way to wait for them."""

    __slots__ = ("request_id", "_replies", "_waiter", "gone", "generation", "entry", "heard", "quiet_since",
                 "missing")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._replies: list[Reply] = []
        self._waiter: asyncio.Future[None] | None = None
        # Set when the client disconnected; wakes whoever waits.
        self.gone = False
        # Once admitted: the quota counters' generation it was counted in, and its in-flight entry
        # (the sorted set, the member).
        self.generation = ""
        self.entry: tuple[str, str] | None = None
        # Watched after a loss of Redis's data: whether anything arrived since the last look, since
        # when nothing did, and whether its in-flight entry was missing at the last look.
        self.heard = False
        self.quiet_since: float | None = None
        self.missing = False

    def push(self, reply: Reply) -> None:
        self._replies.append(reply)
        self.heard = True
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
                 clock: Callable[[], float] = time.monotonic, lost_after_s: float = 15.0) -> None:
        self._redis = redis
        # One pipeline a read, bounded as a whole (redis-py would time each of its replies).
        self._reader = without_read_timeouts(redis)
        self.timeout_s = timeout_s
        self.gateway_id = gateway_id or uuid.uuid4().hex[:16]
        self.stream = contract.gateway_replies(self.gateway_id)
        self._inboxes: dict[str, Inbox] = {}
        self._pumps: dict[int, tuple[Inbox, asyncio.Task[None]]] = {}  # id(inbox) -> it and its pump
        self._clock = clock
        self.lost_after_s = lost_after_s
        # The quota counters' generation last seen ("": none, Redis lost its data); None: not yet read.
        self.generation: str | None = None
        self._changes = 0  # how often it changed: a read sent before a change is stale
        self._watched: dict[int, Inbox] = {}
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name="reply-router")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *(pump for _, pump in self._pumps.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(*REDIS_DOWN):
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
        self._pumps[key] = (inbox, task)
        task.add_done_callback(lambda _t: self._pumps.pop(key, None))
        return inbox

    def admitted(self, inbox: Inbox, inflight: str, request_id: str, generation: str) -> None:
        """The request is admitted: in flight in the sorted set ``inflight`` (its account's, until its
        worker's terminal reply), its unit counted in ``generation``."""
        inbox.generation = generation
        inbox.entry = (inflight, request_id)
        if self.generation is None:
            self.generation = generation
        elif generation != self.generation:
            self._saw(generation)

    def close(self, inbox: Inbox) -> None:
        """The request is over: stop routing to its inbox."""
        key = id(inbox)
        self._watched.pop(key, None)
        pump = self._pumps.pop(key, None)
        if pump is not None:
            pump[1].cancel()
        elif self._inboxes.get(inbox.request_id) is inbox:
            del self._inboxes[inbox.request_id]

    @property
    def holding(self) -> int:
        return len(self._inboxes)

    # -- after Redis lost its data ---------------------------------------------------------------

    def _saw(self, generation: str) -> None:
        """The quota counters' generation now. A change (or none: Redis lost its data, no gateway
        rebuilt the counters yet) means the jobs of requests counted in another generation may be
        gone: watch them. A false alarm (an admission that read the old generation) costs a look at
        their entries."""
        if generation == self.generation:
            return
        self.generation = generation
        self._changes += 1
        now = self._clock()
        watching = 0
        for inbox in [*self._inboxes.values(), *(followed for followed, _ in self._pumps.values())]:
            if inbox.entry is not None and inbox.generation != generation and id(inbox) not in self._watched:
                inbox.heard, inbox.quiet_since, inbox.missing = False, now, False
                self._watched[id(inbox)] = inbox
                watching += 1
        if watching:
            log.warning("the quota counters' generation changed (Redis lost its data?); watching %d requests",
                        watching)

    async def _look(self) -> None:
        """Answer the watched requests that were quiet for ``lost_after_s`` and that are
        gone from its account's in-flight set at two looks in a row (a finished request leaves it just
        before its last reply)."""
        now = self._clock()
        due: list[Inbox] = []
        for inbox in list(self._watched.values()):
            if inbox.heard:  # a reply or a worker's HELD: its job is alive
                inbox.heard, inbox.quiet_since, inbox.missing = False, now, False
            elif inbox.quiet_since is not None and now - inbox.quiet_since >= self.lost_after_s:
                due.append(inbox)
        if not due:
            return
        async with asyncio.timeout(SOCKET_TIMEOUT_S), self._redis.pipeline(transaction=False) as pipe:
            for inbox in due:
                inflight, request_id = inbox.entry  # type: ignore[misc]
                pipe.zscore(inflight, request_id)
            found = await pipe.execute()
        for inbox, score in zip(due, found, strict=True):
            if score is not None:  # still in flight after the loss: queued, or a worker has it
                self._watched.pop(id(inbox), None)
            elif inbox.heard:
                continue
            elif inbox.missing:
                self._watched.pop(id(inbox), None)
                await self._lost(inbox)
            else:
                inbox.missing = True

    async def _lost(self, inbox: Inbox) -> None:
        log.warning("the job of %s was lost with Redis's data", inbox.request_id)
        reply = _job_lost()
        if id(inbox) in self._pumps:  # into its own stream: its pump and any replay read it there
            key = contract.reply_stream(inbox.request_id)
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(key, reply.to_fields())
                    pipe.expire(key, contract.REPLY_TTL_S)
                    await pipe.execute()
                return
            except REDIS_DOWN:
                pass
        inbox.push(reply)

    # -- the readers -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        last = "0-0"
        unread_trimmed = 0  # entries read since the stream was last trimmed
        renew_at = 0.0  # when the stream's TTL is renewed next
        check_at = 0.0  # when the quota counters' generation is read next
        while True:
            now = self._clock()
            trim = last != "0-0" and (unread_trimmed >= _TRIM_EVERY or now >= renew_at)
            renew = now >= renew_at
            check = now >= check_at
            changes = self._changes
            try:
                async with asyncio.timeout(SOCKET_TIMEOUT_S):
                    if trim or renew or check:
                        async with self._reader.pipeline(transaction=False) as pipe:
                            if trim:  # everything before the last entry read
                                pipe.xtrim(self.stream, minid=last, approximate=False)
                            if renew:
                                pipe.expire(self.stream, contract.REPLY_TTL_S)
                            pipe.xread({self.stream: last}, count=_READ_COUNT, block=_BLOCK_MS)
                            if check:  # after the blocking read, so that it is fresh when it comes
                                pipe.get(contract.QUOTA_EPOCH_KEY)
                            results = await pipe.execute()
                        result = results[-2] if check else results[-1]
                    else:  # one command: at one request in flight, a read per reply
                        result = await self._reader.xread({self.stream: last}, count=_READ_COUNT, block=_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN as exc:
                log.warning("reading replies failed (%s); retrying", exc.__class__.__name__)
                await asyncio.sleep(_RETRY_S)
                continue
            if trim:
                unread_trimmed = 0
            if renew:
                renew_at = now + REPLY_RENEW_EVERY_S
            inboxes = self._inboxes
            for _stream, entries in result or ():
                unread_trimmed += len(entries)
                for entry_id, fields in entries:
                    last = entry_id
                    request_id = fields.get(b"i")
                    inbox = inboxes.get(request_id.decode()) if request_id else None
                    if inbox is not None:
                        reply = Reply.from_entry(fields)
                        if reply.kind is ReplyKind.HELD:
                            inbox.heard = True
                        else:
                            inbox.push(reply)
            if check:
                check_at = now + _CHECK_EVERY_S
                generation = results[-1]
                if self._changes == changes:  # else an admission saw a newer one meanwhile
                    self._saw(generation.decode() if generation else "")
                if self._watched:
                    try:
                        await self._look()
                    except REDIS_DOWN as exc:
                        log.warning("looking for lost jobs failed (%s); retrying", exc.__class__.__name__)

    async def _pump(self, key: str, inbox: Inbox) -> None:
        last = "0-0"
        while True:
            try:
                result = await self._redis.xread({key: last}, count=256, block=_BLOCK_MS)
            except REDIS_DOWN:
                await asyncio.sleep(_RETRY_S)
                continue
            for _stream, entries in result or ():
                for entry_id, fields in entries:
                    last = entry_id
                    reply = Reply.from_entry(fields)
                    if reply.kind is ReplyKind.HELD:
                        inbox.heard = True
                        continue
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
