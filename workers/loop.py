"""The worker loop: claim jobs from the pool's stream, run them on the engine, reply, acknowledge.

Many jobs run at once (up to the engine's batch capacity) so vLLM's continuous batching has work;
each job's chunks go to its reply stream as the engine yields them. A job is acknowledged only once
its terminal reply is written (or its client is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from flatfare import contract
from flatfare.contract import Endpoint, Job, Reply, ReplyKind, Usage, WorkerInfo
from flatfare.logs import bind, prompts_enabled
from flatfare.storage.models import Lane
from workers.metrics import WorkerMetrics

log = logging.getLogger("flatfare.worker")

_DONE = "data: [DONE]"


class EngineLike(Protocol):
    max_model_len: int
    max_num_seqs: int

    async def run(self, endpoint: Endpoint, body: dict[str, Any]) -> Any: ...

    def unfinished_requests(self) -> int: ...

    def shutdown(self) -> None: ...

    @property
    def errored(self) -> bool: ...


def now_ms() -> int:
    return int(time.time() * 1000)


def _usage(payload: dict[str, Any]) -> Usage | None:
    usage = payload.get("usage")
    if not usage:
        return None
    return Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                 completion_tokens=int(usage.get("completion_tokens") or 0))


class WorkerLoop:
    def __init__(self, redis: aioredis.Redis, engine: EngineLike, info: WorkerInfo,
                 drain_timeout_s: float = 30.0, metrics: WorkerMetrics | None = None) -> None:
        self.redis = redis
        self.engine = engine
        self.info = info
        self.drain_timeout_s = drain_timeout_s
        self.stream = contract.job_stream(info.model)
        # The lane each stream serves, for the metrics: one stream per pool today, the standard lane.
        self.lanes: dict[str, str] = {self.stream: Lane.STANDARD.value}
        self.metrics = metrics
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        await self._ensure_group()
        background = [asyncio.create_task(self._heartbeat(), name="heartbeat"),
                      asyncio.create_task(self._listen_cancels(), name="cancels")]
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._deregister()

    @property
    def draining(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop taking work; what is held finishes within the drain timeout."""
        self._stopping.set()
        self._slot_freed.set()

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, contract.POOL_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _drain(self) -> None:
        if not self.inflight:
            return
        log.info("draining %d jobs (up to %.0f s)", len(self.inflight), self.drain_timeout_s)
        _, pending = await asyncio.wait(list(self.inflight.values()), timeout=self.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            if self.engine.errored:
                raise RuntimeError("the engine died; exiting so the supervisor restarts this worker")
            free = self.info.capacity - len(self.inflight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            entries = await self.redis.xreadgroup(
                contract.POOL_GROUP, self.info.worker_id, {self.stream: ">"}, count=free, block=1000)
            for stream, messages in entries or []:
                lane = self.lanes.get(stream.decode() if isinstance(stream, bytes) else stream, Lane.STANDARD.value)
                for entry_id, fields in messages:
                    self._start(entry_id, fields, lane)

    def _start(self, entry_id: bytes, fields: dict[bytes, bytes], lane: str = Lane.STANDARD.value) -> None:
        try:
            job = Job.from_fields(fields)
        except (KeyError, ValueError):
            log.error("dropping malformed job %s", entry_id)
            asyncio.create_task(self._ack(entry_id))
            return
        if self.metrics is not None:
            self.metrics.taken(lane, job.enqueued_ms)
        task = asyncio.create_task(self._handle(entry_id, job), name=job.request_id)
        self.inflight[job.request_id] = task
        task.add_done_callback(lambda _t, rid=job.request_id: self._finished(rid))

    def _finished(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)
        self._slot_freed.set()

    async def _ack(self, entry_id: bytes) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, contract.POOL_GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            await pipe.execute()

    # -- one job -----------------------------------------------------------------------------

    async def _handle(self, entry_id: bytes, job: Job) -> None:
        reply_key = contract.reply_stream(job.request_id)
        bind(request_id=job.request_id, model=self.info.model)  # this task's log lines
        try:
            if await self.redis.exists(contract.cancel_key(job.request_id)):
                log.info("skipping %s: its client went away while it was queued", job.request_id)
                self._ended_without_reply("skipped")
                return
            await self._run(job, reply_key, now_ms())
        except asyncio.CancelledError:
            # The client went away (or the drain timed out): the engine request is aborted by
            # closing its generator; nobody reads the reply stream any more.
            self._ended_without_reply("cancelled")
            raise
        except Exception:  # noqa: BLE001 - any engine failure must still answer the client
            log.exception("job %s failed", job.request_id)
            error = {"error": {"message": "The worker failed while running this request; retry it.",
                               "type": "server_error", "param": None, "code": "worker_error"}}
            with contextlib.suppress(Exception):
                await self._reply(reply_key, Reply(ReplyKind.ERROR, json.dumps(error), status=500, started_ms=now_ms()))
        finally:
            await asyncio.shield(self._ack(entry_id))

    async def _run(self, job: Job, reply_key: str, started_ms: int) -> None:
        body = json.loads(job.body)
        if prompts_enabled():  # FLATFARE_LOG_PROMPTS: customers' data, off unless switched on
            log.info("prompt of %s", job.request_id, extra={"prompt": body.get("messages", body.get("prompt"))})
        body["request_id"] = job.request_id
        wants_usage = False
        if body.get("stream"):
            options = body.get("stream_options") or {}
            wants_usage = bool(options.get("include_usage"))
            # Always ask for usage so the ledger gets token counts; drop the chunk if not asked.
            body["stream_options"] = {**options, "include_usage": True}
        result = await self.engine.run(job.endpoint, body)
        if result.error is not None:
            await self._reply(reply_key, Reply(ReplyKind.ERROR, json.dumps(result.error), status=result.error_status,
                                               started_ms=started_ms))
            return
        if result.body is not None:
            usage = _usage(json.loads(result.body))
            if prompts_enabled():
                log.info("output of %s", job.request_id, extra={"output": result.body})
            await self._reply(reply_key, Reply(ReplyKind.RESPONSE, result.body, usage=usage, started_ms=started_ms,
                                               first_token_ms=now_ms()))
            return
        await self._stream(result.stream, reply_key, wants_usage, started_ms)

    async def _stream(self, stream: Any, reply_key: str, wants_usage: bool, started_ms: int) -> None:
        usage: Usage | None = None
        first_token_ms = 0
        try:
            async for event in stream:
                for line in event.split("\n\n"):
                    if not line:
                        continue
                    if line.startswith(_DONE):
                        break
                    payload = line.removeprefix("data: ")
                    if '"choices":[]' in payload and '"usage"' in payload:
                        usage = _usage(json.loads(payload))
                        if not wants_usage:
                            continue
                    first = not first_token_ms
                    if first:
                        first_token_ms = now_ms()
                    # The TTL goes on with the first chunk and is refreshed by the terminal reply.
                    await self._reply(reply_key, Reply(ReplyKind.CHUNK, payload), set_ttl=first)
        finally:
            await stream.aclose()
        await self._reply(reply_key, Reply(ReplyKind.END, usage=usage, started_ms=started_ms,
                                           first_token_ms=first_token_ms))

    async def _reply(self, reply_key: str, reply: Reply, *, set_ttl: bool = True) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(reply_key, reply.to_fields())
            if set_ttl:
                pipe.expire(reply_key, contract.REPLY_TTL_S)
            await pipe.execute()
        if reply.kind.terminal and self.metrics is not None:
            self.metrics.replied(reply)

    def _ended_without_reply(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.ended_without_reply(outcome)

    # -- presence and cancellation ------------------------------------------------------------

    async def _heartbeat(self) -> None:
        pool = contract.pool_key(self.info.model)
        worker = contract.worker_key(self.info.worker_id)
        while True:
            self.info.inflight = len(self.inflight)
            self.info.extra["engine_unfinished"] = self.engine.unfinished_requests()
            now = now_ms()
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hset(worker, mapping=self.info.to_fields())
                    pipe.expire(worker, int(contract.WORKER_TTL_S * 2))
                    pipe.zadd(pool, {self.info.worker_id: now})
                    pipe.zremrangebyscore(pool, "-inf", now - int(contract.WORKER_TTL_S * 4000))
                    pipe.sadd(contract.POOLS_KEY, self.info.model)
                    await pipe.execute()
            except (ConnectionError, OSError, aioredis.RedisError):
                log.warning("heartbeat failed; retrying", exc_info=True)
            await asyncio.sleep(contract.HEARTBEAT_INTERVAL_S)

    async def _deregister(self) -> None:
        with contextlib.suppress(Exception):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(contract.pool_key(self.info.model), self.info.worker_id)
                pipe.delete(contract.worker_key(self.info.worker_id))
                await pipe.execute()

    async def _listen_cancels(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(contract.CANCEL_CHANNEL)
        try:
            async for message in pubsub.listen():
                request_id = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
                task = self.inflight.get(request_id)
                if task is not None:
                    log.info("aborting %s: its client went away", request_id)
                    task.cancel()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
