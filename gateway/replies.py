"""The gateway's side of the reply contract: read a request's replies, cancel it, tidy up.
(Jobs are put on their lanes by :mod:`gateway.queueing`.)"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import Reply
from gateway.errors import APIError

# How long one blocking read waits before the deadline is checked again.
_BLOCK_MS = 2_000


def timed_out() -> APIError:
    return APIError(504, "The request timed out waiting for its worker; retry it.", code="timeout")


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, timeout_s: float) -> None:
        self._redis = redis
        self._timeout_s = timeout_s

    async def replies(self, request_id: str) -> AsyncIterator[list[Reply]]:
        """The request's replies in order, in the batches one read returned (so a streamed answer's
        chunks that arrived together go out in one write), ending with its terminal one; 504 past
        the timeout."""
        key = contract.reply_stream(request_id)
        deadline = time.monotonic() + self._timeout_s
        last_id = "0-0"
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise timed_out()
            result = await self._redis.xread({key: last_id}, count=256, block=min(left_ms, _BLOCK_MS))
            for _stream, entries in result or []:
                batch: list[Reply] = []
                for entry_id, fields in entries:
                    last_id = entry_id
                    batch.append(Reply.from_fields(fields))
                    if batch[-1].kind.terminal:
                        yield batch
                        return
                if batch:
                    yield batch

    async def cancel(self, request_id: str) -> None:
        """Tell the pool the client went away: a queued job is skipped, a running one aborted."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(contract.cancel_key(request_id), 1, ex=contract.CANCEL_TTL_S)
            pipe.publish(contract.CANCEL_CHANNEL, request_id)
            await pipe.execute()

    async def finish(self, request_id: str, keep_s: int = 0) -> None:
        """Drop the reply stream, or keep it ``keep_s`` seconds for replays of an idempotent request."""
        key = contract.reply_stream(request_id)
        if keep_s:
            await self._redis.expire(key, keep_s)
        else:
            await self._redis.delete(key)

    async def has_replies(self, request_id: str) -> bool:
        return bool(await self._redis.exists(contract.reply_stream(request_id)))
