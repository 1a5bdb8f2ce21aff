"""What the soak does to the platform: the request mix, batches, key rotations, restarts, and the samples.

The clients classify every answer as the fault benchmark's do (bench/faults.py ``Clients``: answered,
failed cleanly, cut by a gateway that went away, or lost), with the soak's mix on top: streaming and not,
clients that hang up after the first chunk, requests retried with the same ``Idempotency-Key``. They send
with aiohttp, as the overhead bench's load generator does (bench/loadgen.py): about a tenth of httpx's CPU a
request. The load generator shares the machine's cores with the platform, and a restart's backlog used to
cost it enough more CPU (httpx) that the platform never caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random
import re
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson
import psutil
import redis as redis_py

from bench.faults import Clients, Rig
from flatfare import contract
from flatfare.loop_tasks import NAME as TASKS_METRIC

# The roles sampled: chaos restarts the first gateway and the first worker, so the second of each runs
# the whole soak and is the one whose growth counts.
ROLES = ("gateway0", "gateway1", "worker0", "worker1")
SURVIVORS = ("gateway1", "worker1")
# Unanswered requests the clients hold at most (below the client's pool of 512 connections).
MAX_IN_FLIGHT = 256
# What varies within one kind of Redis key: numbers, hex and base-62 ids, request ids.
_ID = re.compile(r"(?<=[:{])[^:{}]*\d[^:{}]*")


@dataclass(frozen=True)
class Mix:
    """The share of requests of each kind (the rest: plain requests, streaming at ``stream``)."""

    stream: float = 0.5
    disconnect: float = 0.03  # a streaming request whose client hangs up after its first chunk
    retry: float = 0.03  # sent twice with one Idempotency-Key: the second is a replay, never a second charge


@dataclass
class Done:
    """One request as the clients saw it: when it started (seconds into the soak) and how long it took."""

    at_s: float
    seconds: float
    answered: bool


@dataclass
class Events:
    disconnected: int = 0
    retried: int = 0
    replay_mismatch: int = 0  # a retry whose answer named another request id
    rotations: int = 0
    restarts: list[tuple[float, str]] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)
    chaos_errors: list[str] = field(default_factory=list)
    dropped: list[float] = field(default_factory=list)  # arrivals not sent: MAX_IN_FLIGHT were unanswered
    # Each lost request: when (s into the soak), the gateway's port and the pid answering there then, and why.
    lost: list[dict[str, Any]] = field(default_factory=list)


class SoakClients(Clients):
    """The fault benchmark's clients, with the soak's mix and every request's latency kept.

    The requests of the load go through one aiohttp session (made inside the running event loop); the
    chores (batches, rotations) keep the inherited httpx client: a few requests a minute.
    """

    def __init__(self, rig: Rig, mix: Mix, started: float) -> None:
        super().__init__(rig, stream_share=mix.stream, timeout_s=60.0)
        self.mix = mix
        self.started = started
        self.done: list[Done] = []
        self.events = Events()
        self._pick = random.Random(7)
        # No limit on connections (MAX_IN_FLIGHT bounds them); an idle one is closed after 15 s, well before
        # the gateway's 65 s (FLATFARE_KEEP_ALIVE_S), so the client always closes first.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15.0),
                                              timeout=aiohttp.ClientTimeout(total=self._timeout_s))

    async def close(self) -> None:
        await self._session.close()
        await super().close()

    def _request(self, port: int, body: dict[str, Any], **headers: str) -> Any:
        return self._session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=orjson.dumps(body),
                                  headers={"Authorization": f"Bearer {self.rig.key}",
                                           "Content-Type": "application/json", **headers})

    async def one(self) -> str | None:
        """As ``Clients.one`` (the same classification, ``Clients._classify``), on aiohttp."""
        port = self._port()
        stream = self._random.random() < self._stream_share
        body = {"model": self.rig.model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                "max_tokens": 8}
        try:
            async with asyncio.timeout(self._timeout_s), self._request(port, body) as response:
                return await self._classify(port, stream, response.status, response.read, _lines(response.content),
                                            response.headers.get("x-request-id", ""))
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._answered_or_lost(False, port, f"{exc.__class__.__name__}: {exc}")
            return None

    def _answered_or_lost(self, ok: bool, port: int, why: str) -> bool:
        """As the fault clients classify, and each lost request kept with where and when it was lost (a
        connection of a gateway being restarted, or one a live gateway closed, can then be told apart)."""
        lost_before = self.tally.lost
        answered = super()._answered_or_lost(ok, port, why)
        if self.tally.lost > lost_before:
            index = self.rig.ports.index(port)
            service = self.rig.gateway_procs[index]
            self.events.lost.append({"at_s": round(time.monotonic() - self.started, 2), "port": port,
                                     "gateway": f"gateway{index}", "pid": service.pid if service else None,
                                     "why": why[:200]})
        return answered

    async def soak_one(self) -> None:
        at = time.monotonic()
        roll = self._pick.random()
        if roll < self.mix.disconnect:
            await self._hang_up()
            return
        if roll < self.mix.disconnect + self.mix.retry:
            answered = await self._retried()
        else:
            answered = await self.one() is not None
        self.done.append(Done(at - self.started, time.monotonic() - at, answered))

    async def _hang_up(self) -> None:
        """A streaming request whose client goes away after the first chunk (its row closes cancelled)."""
        body = {"model": self.rig.model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 8}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(30), self._request(self._port(), body) as response:
                async for _line in response.content:
                    break
                response.close()  # the connection, not back to the pool: the gateway sees the client go
        self.events.disconnected += 1

    async def _retried(self) -> bool:
        """One request sent twice with the same Idempotency-Key; the second must replay the first."""
        key = uuid.uuid4().hex
        body = {"model": self.rig.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        ids = []
        for _ in range(2):
            port = self._port()
            try:
                async with self._request(port, body, **{"Idempotency-Key": key}) as response:
                    status, content = response.status, await response.read()
                    ids.append(response.headers.get("x-request-id"))
            except (aiohttp.ClientError, TimeoutError) as exc:  # httpx counted its timeouts as HTTP errors too
                self._answered_or_lost(False, port, f"{exc.__class__.__name__}: {exc}")
                return False
            if status != 200:
                self._error(content, status)
                return False
        self.events.retried += 1
        self.events.replay_mismatch += ids[0] != ids[1]
        return self._answered_or_lost("choices" in orjson.loads(content), port, "200 without choices")

    async def open_loop_until(self, rate: float, until_s: float) -> None:
        """``rate`` requests a second until ``until_s`` seconds into the soak, whatever the answers take, but
        never more than ``MAX_IN_FLIGHT`` unanswered: an arrival past that is dropped and counted (the
        platform fell behind), rather than queued in the client, where a growing backlog would make the
        load generator itself the bottleneck."""
        tasks: set[asyncio.Task[None]] = set()
        sent = 0
        while (now := time.monotonic() - self.started) < until_s:
            due = max(int(now * rate) - sent, 0)
            for _ in range(due):
                if len(tasks) >= MAX_IN_FLIGHT:
                    self.events.dropped.append(round(now, 2))
                    continue
                task = asyncio.create_task(self.soak_one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            sent += due
            await asyncio.sleep(0.01)
        if tasks:
            await asyncio.gather(*tasks)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """A response body's lines without their line ends, as httpx's ``aiter_lines`` gives them."""
    async for raw in content:
        yield raw.decode(errors="replace").rstrip("\r\n")


# -- batches, rotations, restarts -------------------------------------------------------------------


async def submit_batch(clients: SoakClients, lines: int) -> None:
    data = b"".join(orjson.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": clients.rig.model, "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}]}}) + b"\n"
                    for i in range(lines))
    base, headers = f"http://127.0.0.1:{clients._port()}", {"Authorization": f"Bearer {clients.rig.key}"}
    try:
        made = await clients._client.post(f"{base}/v1/files", headers=headers, data={"purpose": "batch"},
                                          files={"file": ("lines.jsonl", data, "application/jsonl")})
        batch = await clients._client.post(f"{base}/v1/batches", headers=headers, json={
            "input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        clients.events.batches.append(batch.json()["id"])
    except (httpx.HTTPError, KeyError, ValueError) as exc:  # a restart's moment: the next one goes through
        clients.events.chaos_errors.append(f"batch not submitted: {exc!r}"[:200])


async def rotate_key(clients: SoakClients, admin_token: str, grace_s: int) -> None:
    """Rotate the account's newest key through the admin API; clients switch to the new one at once."""
    base, headers = f"http://127.0.0.1:{clients._port()}/admin/v1", {"Authorization": f"Bearer {admin_token}"}
    try:
        keys = (await clients._client.get(f"{base}/accounts/{clients.rig.account_id}/keys", headers=headers,
                                          params={"limit": 100})).json()["data"]
        newest = max(k["id"] for k in keys if not k.get("revoked_at"))
        made = await clients._client.post(f"{base}/keys/{newest}/rotate", headers=headers,
                                          json={"grace_seconds": grace_s})
        clients.rig.key = made.json()["key"]
        clients.events.rotations += 1
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        clients.events.chaos_errors.append(f"rotation failed: {exc!r}"[:200])


def restart_gateway(rig: Rig, index: int) -> None:
    """As a rolling deploy does: the load balancer stops sending to it, it drains (SIGTERM), a new one starts."""
    service = rig.gateway_procs[index]
    assert service is not None
    rig.dead_ports.add(rig.ports[index])
    rig.services.stop(service)
    rig.start_gateway(index)


def restart_worker(rig: Rig, index: int) -> None:
    """SIGTERM (the worker drains its jobs), then a new worker on the same model, waited until warm."""
    rig.services.stop(rig.worker_procs[index])
    rig.restart_worker(index)


# -- the samples ------------------------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tasks(url: str) -> int | None:
    """The event loop's tasks, from a process's /metrics (flatfare_event_loop_tasks)."""
    try:  # urllib, not httpx.get: that builds a client and its SSL context on each call
        with urllib.request.urlopen(url, timeout=3) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):  # URLError and timeouts are OSErrors
        return None
    for line in text.splitlines():
        if line.startswith(TASKS_METRIC + "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def _metrics_urls(rig: Rig, client: redis_py.Redis) -> dict[str, str]:
    """Where each live process serves /metrics: a gateway on its port, a worker on the port its heartbeat names."""
    urls = {f"gateway{i}": f"http://127.0.0.1:{port}/metrics" for i, port in enumerate(rig.ports)
            if port not in rig.dead_ports}
    for member in client.zrange(contract.pool_key(rig.model), 0, -1):
        extra = json.loads(client.hget(contract.worker_key(member.decode()), "extra") or "{}")
        for i, worker in enumerate(rig.worker_procs):
            if worker.alive() and f"-{worker.pid}-".encode() in member and extra.get("metrics_port"):
                urls[f"worker{i}"] = f"http://127.0.0.1:{extra['metrics_port']}/metrics"
    return urls


def key_kinds(client: redis_py.Redis) -> dict[str, list[int]]:
    """Redis keys by kind (the key with its ids taken out): [keys, keys without an expiry]. A kind that
    expires is bounded by its rate times its TTL; one that grows without an expiry is a leak."""
    keys = list(client.scan_iter(count=1000))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.ttl(key)
        ttls = pipe.execute()
    kinds: dict[str, list[int]] = {}
    for key, ttl in zip(keys, ttls, strict=True):
        counts = kinds.setdefault(_ID.sub("*", key.decode(errors="replace")), [0, 0])
        counts[0] += 1
        counts[1] += ttl == -1
    return kinds


def sample(rig: Rig, at_s: float, database_file: str) -> dict[str, Any]:
    """One look at every process (with its children) and at Redis and the database."""
    # The load generator's CPU (this process: the clients and this sampler) beside the platform's: on a
    # machine they share, a load generator that needs more per request under a backlog shows here.
    row: dict[str, Any] = {"at_s": round(at_s, 1), "loadgen_cpu_s": round(time.process_time(), 2)}
    services = {f"gateway{i}": s for i, s in enumerate(rig.gateway_procs)}
    services |= {f"worker{i}": s for i, s in enumerate(rig.worker_procs)}
    assert rig.redis is not None
    client = redis_py.Redis.from_url(rig.redis.url)
    try:
        urls = _metrics_urls(rig, client)
        row["redis_mib"] = round(int(client.info("memory")["used_memory"]) / 2**20, 2)
        row["redis_keys"] = int(client.dbsize())
        row["redis_kinds"] = key_kinds(client)
    finally:
        client.close()
    db_files = 0
    for role in ROLES:
        service = services.get(role)
        procs = _tree(service.pid) if service is not None and service.alive() else []
        rss = fds = threads = 0
        cpu = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                rss += proc.memory_info().rss
                cpu += sum(proc.cpu_times()[:2])
                fds += proc.num_fds()
                threads += proc.num_threads()
                if database_file:
                    db_files += sum(1 for f in proc.open_files() if f.path.startswith(database_file))
        row[role] = {"pid": service.pid if procs else None, "rss_mib": round(rss / 2**20, 1), "fds": fds,
                     "threads": threads, "cpu_s": round(cpu, 2), "tasks": _tasks(urls[role]) if role in urls else None}
    # Meter events waiting for the billing outbox: a load past its rate shows as a backlog that grows.
    row["outbox_pending"] = int(rig.sql("SELECT count(*) FROM usage_outbox WHERE status = 'pending'")[0][0])
    if rig.pg is not None:
        row["db_connections"] = int(rig.sql("SELECT count(*) - 1 FROM pg_stat_activity "
                                            "WHERE datname = current_database()")[0][0])
    else:
        row["db_connections"] = db_files
    return row
