"""One `flatfare worker` on the real vLLM CPU engine, on a private redis-server and SQLite catalog, with
jobs queued the way a gateway's admission queues them and answers read from the gateway's reply stream.
For what only the worker decides (its commands, its LoRA variants), without a gateway in the way."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis as redis_sync
from sqlalchemy import create_engine, text

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane, Reply, WorkerInfo, WorkerState
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue, QuotaClaim
from flatfare.redis_conn import connect
from flatfare.redis_local import LocalRedis
from flatfare.storage.db import migrate
from tests.conftest import MODELS_DIR, eventually, stop_process, sync_url

MODEL = "smollm2-135m-instruct"
INBOX = contract.gateway_replies("test")
START_TIMEOUT_S = 600
ANSWER_TIMEOUT_S = 120


@dataclass
class RealWorker:
    process: subprocess.Popen[bytes]
    worker_id: str
    redis: redis_sync.Redis
    redis_url: str
    log: Path
    # Every heartbeat seen while it started (the phases it went through).
    seen_starting: list[WorkerInfo]

    def info(self) -> WorkerInfo | None:
        fields = self.redis.hgetall(contract.worker_key(self.worker_id))
        return WorkerInfo.from_fields(fields) if fields else None

    def ask(self, body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> Reply:
        """Queue one job for the worker's pool and wait for its terminal reply."""
        request_id = uuid.uuid4().hex
        asyncio.run(_admit(self.redis_url, Job(request_id=request_id, endpoint=endpoint, body=json.dumps(body),
                                               enqueued_ms=int(time.time() * 1000), reply_to=INBOX,
                                               account_id=1)))
        return eventually(lambda: self._terminal(request_id), lambda r: r is not None, f"the answer to {request_id}",
                          timeout_s=ANSWER_TIMEOUT_S, every_s=0.1)

    def _terminal(self, request_id: str) -> Reply | None:
        for _, fields in self.redis.xrange(INBOX):
            if fields[b"i"] == request_id.encode():
                reply = Reply.from_fields(fields)
                if reply.kind.terminal:
                    return reply
        return None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


async def _admit(redis_url: str, job: Job) -> None:
    client = connect(redis_url)
    try:
        await client.set(EPOCH_KEY, 1, nx=True)
        queue = LaneQueue(client, {lane: LaneLimits(1000, 60.0) for lane in Lane})
        window = quota_window("UTC", datetime.now(UTC))
        await queue.admit(job, MODEL, QuotaClaim(job.account_id, window.day, None, expiry(window.resets_at),
                                                 inflight_expires_ms=int(time.time() * 1000) + 600_000))
    finally:
        await client.aclose()


def sql(database_url: str, query: str, **params: object) -> None:
    """Change the worker's catalog."""
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            conn.execute(text(query), params)
    finally:
        engine.dispose()


@contextmanager
def real_worker(data: Path, *, engine_options: dict[str, Any], env: dict[str, str] | None = None,
                args: tuple[str, ...] = (), before_start: Callable[[str], None] = lambda _url: None
                ) -> Iterator[RealWorker]:
    """A worker of the built-in SmolLM2 with ``engine_options`` set in its catalog entry; ``before_start``
    gets the catalog's database URL first. Warm when this yields; SIGTERM (if still running) on exit."""
    data.mkdir(parents=True, exist_ok=True)
    database_url = f"sqlite:///{data / 'flatfare.db'}"
    migrate(database_url)
    sql(database_url, "UPDATE models SET engine_options = :options WHERE name = :name",
        options=json.dumps(engine_options), name=MODEL)
    before_start(database_url)
    server = LocalRedis(data / "redis", persist=False).start()
    client = redis_sync.Redis.from_url(server.url)
    worker_id = f"real-{uuid.uuid4().hex[:6]}"
    log = data / "worker.log"
    full_env = {**os.environ, "FLATFARE_DATA_DIR": str(data), "FLATFARE_MODELS_DIR": str(MODELS_DIR),
                "FLATFARE_DATABASE_URL": database_url, "FLATFARE_REDIS_URL": server.url,
                "FLATFARE_WORKER_ID": worker_id, "FLATFARE_METRICS_PORT": "-1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1", **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--model", MODEL, *args], env=full_env,
                               cwd=data, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    worker = RealWorker(process, worker_id, client, server.url, log, [])
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            info = worker.info()
            if info is not None and info.state is WorkerState.WARM:
                break
            if info is not None:
                worker.seen_starting.append(info)
            assert process.poll() is None, f"the worker exited with {process.returncode}:\n{worker.tail()}"
            assert time.monotonic() < deadline, f"the worker was not warm within {START_TIMEOUT_S} s:\n{worker.tail()}"
            time.sleep(0.1)
        yield worker
    finally:
        stop_process(process)
        client.close()
        server.stop()
