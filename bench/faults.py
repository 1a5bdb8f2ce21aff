"""Faults under load, as figures: kill, stop and break Flatfare's parts while clients send requests.

Each scenario starts its own platform (``Rig``: Redis, SQLite or a private PostgreSQL, workers,
gateway processes, Stripe's edge), drives it with real HTTP clients, injects one kind of fault, lets
the platform settle, then audits every account of the money: requests the clients sent, answered,
failed cleanly (an OpenAI error body, or an error event closing a stream), cut (the connection of
a gateway that was killed), **lost** (no answer and no clean error, or a hang), and the money
(bench/audit.py): requests **billed twice** in the ledger, meter events **sent twice** to Stripe
(its edge records every call, those it refuses included), billable requests Stripe never kept and
events it got for requests not billable, and the quota units counted in Redis against billable
ledger rows and units given back. The goal in every row: 0 lost, 0 billed or sent twice, 0 missing
or extra, 0 units unaccounted, counted = ledger = outbox = Stripe.

``python -m bench faults`` writes bench/results/faults.md and faults.csv; tests/faults runs the same
scenarios with fewer repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import orjson
import redis as redis_py
from sqlalchemy import create_engine, text

from bench.audit import Audit, read_books, sync_url
from bench.audit import audit as audit_books
from bench.postgres import PrivatePostgres, postgres_unavailable
from bench.procs import Service, Services, free_port
from bench.stripe_edge import StripeEdge
from flatfare import contract
from flatfare.redis_local import LocalRedis

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
MODEL = "instant"
CPU_MODEL = "smollm2-135m-instruct"
ACCOUNT = "faults"
PRICE_MICROS = 1000
FAKETIME = REPO_ROOT / ".venv" / "lib" / "faketime" / "libfaketimeMT.so.1"


# -- the platform under test ----------------------------------------------------------------------


class Unavailable(Exception):
    """This machine cannot run the scenario (said in the table, and a skip in the tests)."""


@dataclass
class Shape:
    """How the instant engine behaves: how long a request holds a worker."""

    tokens: int = 8
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.02


@dataclass
class Rig:
    """One platform: Redis, a database, ``workers`` workers, ``gateways`` gateway processes (one port
    each, as behind a load balancer), Stripe's edge, and an account on a priced plan."""

    workdir: Path
    services: Services
    # "instant" (no model, the shape below), or "vllm": the real CPU engine with the default model.
    engine: str = "instant"
    workers: int = 2
    gateways: int = 1
    shape: Shape = field(default_factory=Shape)
    daily_limit: int | None = None
    persist_redis: bool = False
    postgres: bool = False
    # Per gateway: seconds its clock is ahead of the real one (libfaketime), for the day boundary. Each
    # gateway's clock follows a file (the first one's also the workers' and the commands'), so
    # set_clock_offsets and hold_clocks move the clocks of running processes.
    clock_offsets_s: list[float] | None = None
    request_timeout_s: float = 10.0
    # Jobs each worker holds at once (0: the engine's capacity); fewer make jobs queue in Redis.
    max_inflight: int = 0
    # How long the outbox's sender waits for Stripe's answer before it retries, and the longest it backs
    # off after a failure (the tests' stripe_failing shortens both: each answer Stripe's edge holds costs
    # the sender's group of calls a whole timeout).
    stripe_timeout_s: float = 1.0
    outbox_max_backoff_s: float = 4.0
    # How long the gateways keep idempotent answers (None: the setting's own default, 24 h).
    idempotency_window_s: int | None = None
    redis: LocalRedis | None = None
    pg: PrivatePostgres | None = None
    edge: StripeEdge | None = None
    database_url: str = ""
    key: str = ""
    account_id: int = 0
    worker_procs: list[Service] = field(default_factory=list)
    gateway_procs: list[Service | None] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    dead_ports: set[int] = field(default_factory=set)

    @property
    def model(self) -> str:
        return MODEL if self.engine == "instant" else CPU_MODEL

    # ---- start ----

    def env(self, clock: int = 0) -> dict[str, str]:
        """Every process's environment; with clock offsets, its clock is gateway ``clock``'s (the first
        gateway's for the workers and the commands)."""
        assert self.redis is not None and self.edge is not None
        faked = {}
        if self.clock_offsets_s is not None:
            if not FAKETIME.exists():
                raise Unavailable(f"no libfaketime at {FAKETIME} (scripts/install.sh unpacks it)")
            # Read again at every call (no cache): a new offset applies at once. FAKETIME itself must
            # be unset, or it wins over the file.
            faked = {"LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self._clock_file(clock)),
                     "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
        environ = {k: v for k, v in os.environ.items() if k != "FAKETIME"}
        # A gateway whose clock is ahead sees the others' heartbeats older by as much: without the
        # skew added, it reaped a live fellow on a loaded machine (its flush late by 1.5 s).
        skew = max(self.clock_offsets_s) - min(self.clock_offsets_s) if self.clock_offsets_s else 0.0
        return {**environ, **faked,
                "FLATFARE_DATA_DIR": str(self.workdir), "FLATFARE_DATABASE_URL": self.database_url,
                "FLATFARE_REDIS_URL": self.redis.url, "FLATFARE_LOG_LEVEL": "warning",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])),
                # workers: a dead worker's jobs are taken over after 1.5 s
                "FLATFARE_JOB_LEASE_S": "1.5", "FLATFARE_DRAIN_TIMEOUT_S": "20",
                "FLATFARE_INSTANT_TOKENS": str(self.shape.tokens),
                "FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": str(self.shape.first_token_delay_s),
                "FLATFARE_INSTANT_TOKEN_DELAY_S": str(self.shape.token_delay_s),
                # gateways: a silent one is settled after 3 s; Stripe answers within its timeout (1 s) or
                # is retried
                "FLATFARE_GATEWAY_DEAD_AFTER_S": f"{3 + skew:g}", "FLATFARE_REQUEST_TIMEOUT_S": str(self.request_timeout_s),
                "FLATFARE_LOST_JOB_AFTER_S": "2", "FLATFARE_MAX_INFLIGHT": str(self.max_inflight),
                "FLATFARE_STRIPE_API_KEY": "sk_test_faults", "FLATFARE_STRIPE_WEBHOOK_SECRET": "whsec_faults",
                "FLATFARE_STRIPE_API_BASE": self.edge.url, "FLATFARE_STRIPE_TIMEOUT_S": f"{self.stripe_timeout_s:g}",
                "FLATFARE_BILLING_OUTBOX_INTERVAL_S": "0.2",
                "FLATFARE_BILLING_OUTBOX_MAX_BACKOFF_S": f"{self.outbox_max_backoff_s:g}",
                # the real engine: eager mode starts in ~40 s; prepared models are shared with the tests
                "FLATFARE_MODELS_DIR": os.environ.get("FLATFARE_TEST_MODELS_DIR",
                                                      str(Path.home() / ".flatfare" / "models")),
                "FLATFARE_ENGINE_OPTIONS": '{"enforce_eager": true}', "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                **({"FLATFARE_IDEMPOTENCY_WINDOW_S": str(self.idempotency_window_s)}
                   if self.idempotency_window_s is not None else {})}

    def start(self) -> Rig:
        """Every process started as soon as what it needs runs, their start-ups overlapping: the instant
        engine's workers need only Redis, so they start beside the database; the gateways need the
        priced plan (start_books), and start together. The real engine's workers read the model
        catalog, and start once the database is made; the gateways once they are warm (an engine
        starting is starved by anything beside it)."""
        self._start_stores()
        if self.engine == "instant":
            self._start_workers()
        self._open_books()
        if self.engine != "instant":
            self._start_workers()
            self._wait_workers()
        self.ports = [free_port() for _ in range(self.gateways)]
        self.dead_ports = set(self.ports)  # none answers yet
        self.gateway_procs = [self._gateway(index) for index in range(self.gateways)]
        self._wait_workers()
        for index in range(self.gateways):
            self.wait_gateway(index)
            self.dead_ports.discard(self.ports[index])
        return self

    def _start_workers(self) -> None:
        for index in range(self.workers):
            self.worker_procs.append(self._worker(index))

    def _wait_workers(self) -> None:
        for worker in self.worker_procs:
            self.wait_worker(worker)

    def start_books(self) -> Rig:
        """Where the money is recorded, without a process to move it: Stripe's edge, Redis, the
        migrated database and the account with its key (tests/faults/test_audit.py plants faults in them)."""
        self._start_stores()
        return self._open_books()

    def _start_stores(self) -> None:
        """Stripe's edge and Redis (and the clocks' files: every process started reads them)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.clock_offsets_s is not None:
            self.set_clock_offsets(self.clock_offsets_s)
        self.edge = StripeEdge(seed=7).start()
        self.redis = LocalRedis(self.workdir / "redis", persist=self.persist_redis).start()

    def _open_books(self) -> Rig:
        """The database, migrated, with the account, its key and its priced plan."""
        if self.postgres:
            reason = postgres_unavailable()
            if reason:
                raise Unavailable(reason)
            self.pg = PrivatePostgres(self.services, self.workdir).start()
            self.database_url = self.pg.url
        else:
            self.database_url = f"sqlite+aiosqlite:///{self.workdir / 'flatfare.db'}"
        env = self.env()
        flatfare = [sys.executable, "-m", "flatfare"]
        subprocess.run([*flatfare, "migrate"], env=env, check=True, cwd=self.workdir, capture_output=True)
        made = subprocess.run([*flatfare, "keys", "create", "--account", ACCOUNT, "--plan", "pro"], env=env,
                              check=True, cwd=self.workdir, capture_output=True, text=True)
        self.key = made.stdout.strip().splitlines()[-1]
        # No in-flight cap: the scenarios' clients are one account's, many at once (the cap's refusals
        # have tests of their own; here they would only hide what a fault does).
        self.sql("UPDATE plans SET daily_limit = :limit, price_per_request_micros = :price, max_inflight = NULL "
                 "WHERE name = 'pro'", limit=self.daily_limit, price=PRICE_MICROS)
        self.sql("UPDATE accounts SET stripe_customer_id = 'cus_faults' WHERE name = :name", name=ACCOUNT)
        self.account_id = self.sql("SELECT id FROM accounts WHERE name = :name", name=ACCOUNT)[0][0]
        return self

    def _worker(self, index: int) -> Service:
        env = self.env()
        if self.engine == "vllm":  # a core each: two engines on the same cores starve the one starting
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
        return self.services.start(Service(
            f"worker{index}", [sys.executable, "-m", "flatfare", "worker", "--model", self.model, "--engine", self.engine],
            self.workdir / f"worker{index}.log", env=env, cwd=str(self.workdir)))

    def start_gateway(self, index: int) -> None:
        """Start gateway ``index``; clients send to it once it answers (as a load balancer would)."""
        self.gateway_procs[index] = self._gateway(index)
        self.wait_gateway(index)
        self.dead_ports.discard(self.ports[index])

    def _gateway(self, index: int) -> Service:
        env = self.env(clock=index)
        argv = [sys.executable, "-m", "flatfare", "gateway", "--port", str(self.ports[index]), "--processes", "1"]
        return self.services.start(Service(f"gateway{index}", argv, self.workdir / f"gateway{index}.log",
                                           env=env, cwd=str(self.workdir)))

    def _clock_file(self, index: int) -> Path:
        return self.workdir / f"clock{index}.faketime"

    def set_clock_offsets(self, offsets_s: list[float]) -> None:
        """Per gateway, how many seconds its clock is ahead of the real one, from now on (the first
        gateway's also for the workers); running processes follow within a call of their clock."""
        self.clock_offsets_s = list(offsets_s)
        for index, offset in enumerate(offsets_s):
            self._write_clock(index, f"{offset:+.6f}")

    def hold_clocks(self, times: list[datetime]) -> None:
        """Per gateway, the time its clock shows, standing still until set_clock_offsets lets it run
        (libfaketime's absolute time; sleeps and timeouts run on the real monotonic clock meanwhile)."""
        for index, at in enumerate(times):
            self._write_clock(index, f"{at.astimezone(UTC):%Y-%m-%d %H:%M:%S.%f}")

    def _write_clock(self, index: int, spec: str) -> None:
        moved = self._clock_file(index).with_suffix(".new")
        moved.write_text(spec + "\n")
        moved.replace(self._clock_file(index))  # whole: a clock never reads half a file

    def wait_worker(self, worker: Service) -> None:
        assert self.redis is not None
        client = redis_py.Redis.from_url(self.redis.url)

        def warm() -> bool:  # it heartbeats (a worker's id holds its pid) with its engine running
            return any(f"-{worker.pid}-".encode() in member
                       and client.hget(contract.worker_key(member.decode()), "state") == b"warm"
                       for member in client.zrange(contract.pool_key(self.model), 0, -1))

        try:
            worker.wait_ready(warm, 600)
        finally:
            client.close()

    def wait_gateway(self, index: int) -> None:
        def answers() -> bool:
            return httpx.get(f"http://127.0.0.1:{self.ports[index]}/healthz", timeout=1).status_code == 200

        service = self.gateway_procs[index]
        assert service is not None
        service.wait_ready(answers, 60)

    def restart_worker(self, index: int) -> None:
        self.worker_procs[index] = self._worker(index)
        self.wait_worker(self.worker_procs[index])

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal the worker; SIGKILL takes its engine's processes with it (its process group)."""
        pid = self.worker_procs[index].pid
        if sig == signal.SIGKILL:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)

    def kill_gateway(self, index: int) -> None:
        service = self.gateway_procs[index]
        assert service is not None
        self.dead_ports.add(self.ports[index])
        os.killpg(service.pid, signal.SIGKILL)  # the server and its worker process
        service.process.wait()  # type: ignore[union-attr]
        self.services.stop(service)
        self.gateway_procs[index] = None

    def stop(self) -> None:
        # The gateways and workers told to stop all at once (each drains on its own), and waited for
        # before anything else: PostgreSQL's smart shutdown waits for its clients to leave.
        running = [s for s in (*self.gateway_procs, *self.worker_procs) if s is not None and s.alive()]
        for service in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.pid, signal.SIGTERM)
        for service in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(timeout=20)  # type: ignore[union-attr]
            self.services.stop(service)  # what outlived it (SIGKILL to its group), or it after 20 s
        self.services.stop_all()
        if self.redis is not None:
            self.redis.stop()
        if self.pg is not None:
            self.pg.stop()
        if self.edge is not None:
            self.edge.stop()

    # ---- look ----

    def sql(self, query: str, **params: object) -> list[tuple]:
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.begin() as conn:
                result = conn.execute(text(query), params)
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            engine.dispose()

    def audit(self) -> Audit:
        """Every account of the money (bench.audit), from the ledger, Redis and Stripe's edge."""
        assert self.redis is not None and self.edge is not None
        return audit_books(read_books(self.database_url, self.redis.url, self.edge.received))

    def settle(self, timeout_s: float = 45.0) -> Audit:
        """Wait until nothing is open, every unit is accounted for and Stripe has every event."""
        deadline = time.monotonic() + timeout_s
        while True:
            audit = self.audit()
            if audit.settled or time.monotonic() > deadline:
                return audit
            time.sleep(0.2)


# -- the clients ----------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients saw."""

    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # clean errors by code
    cut: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    # Answered requests whose quota day the scenario knows, request id -> day (day_boundary: sent while
    # every clock stood before midnight, or once every clock had passed it); run_scenario checks the ledger.
    known_days: dict[str, str] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return self.answered + sum(self.failed.values()) + self.cut + self.lost


class Clients:
    """Sends chat completions to the rig's live gateways and classifies every answer."""

    def __init__(self, rig: Rig, stream_share: float = 0.5, timeout_s: float = 30.0) -> None:
        self.rig = rig
        self.tally = Tally()
        self._stream_share = stream_share
        self._timeout_s = timeout_s
        self._random = random.Random(1)
        self._next = 0
        # Every connection kept for reuse: with httpx's default of 20 kept, a burst past 20 in flight opens
        # (and closes) a connection per request, which costs both sides enough CPU to keep the burst going.
        self._client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=512,
                                                                                max_keepalive_connections=512))

    async def close(self) -> None:
        await self._client.aclose()

    def _port(self) -> int:
        live = [p for p in self.rig.ports if p not in self.rig.dead_ports]
        self._next += 1
        return live[self._next % len(live)]

    async def one(self) -> str | None:
        """Send one request and classify its answer; the request id (x-request-id) if it was answered."""
        port = self._port()
        stream = self._random.random() < self._stream_share
        body = {"model": self.rig.model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                "max_tokens": 8}
        headers = {"Authorization": f"Bearer {self.rig.key}"}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._client.stream("POST", url, json=body, headers=headers) as response:
                    return await self._classify(port, stream, response.status_code, response.aread,
                                                response.aiter_lines(), response.headers.get("x-request-id", ""))
        except (httpx.HTTPError, TimeoutError) as exc:
            self._answered_or_lost(False, port, f"{exc.__class__.__name__}: {exc}")
            return None

    async def _classify(self, port: int, stream: bool, status: int, body: Callable[[], Awaitable[bytes]],
                        lines: AsyncIterator[str], request_id: str) -> str | None:
        """Classify an answer that came (``body`` reads it whole, ``lines`` streams it, whichever HTTP client
        read it); ``request_id`` if it was answered."""
        if status != 200:
            self._error(await body(), status)
            return None
        if stream:
            answered = await self._read_stream(lines, port)
        else:
            answered = self._answered_or_lost("choices" in orjson.loads(await body()), port, "200 without choices")
        return request_id if answered else None

    async def _read_stream(self, lines: AsyncIterator[str], port: int) -> bool:
        """Classify a stream by its lines, without their line ends (whichever HTTP client read them)."""
        code, done = None, False
        async for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {\"error\""):
                code = (orjson.loads(line[6:])["error"] or {}).get("code") or "error"
        if done and code:
            self.tally.failed[str(code)] += 1
            return False
        return self._answered_or_lost(done, port, "stream ended without [DONE]")

    def _error(self, raw: bytes, status: int) -> None:
        try:
            error = orjson.loads(raw)["error"]
            self.tally.failed[f"{status} {error.get('code') or error.get('type')}"] += 1
        except (orjson.JSONDecodeError, KeyError, TypeError):
            self.tally.lost += 1
            self.tally.lost_examples.append(f"{status} without an error body: {raw[:120]!r}")

    def _answered_or_lost(self, ok: bool, port: int, why: str) -> bool:
        if ok:
            self.tally.answered += 1
        elif port in self.rig.dead_ports:
            self.tally.cut += 1
        else:
            self.tally.lost += 1
            if len(self.tally.lost_examples) < 5:
                self.tally.lost_examples.append(why)
        return ok

    async def closed_loop(self, concurrency: int, until: Callable[[], bool]) -> None:
        async def client() -> None:
            while not until():
                await self.one()

        await asyncio.gather(*(client() for _ in range(concurrency)))

    async def open_loop(self, rate: float, duration_s: float) -> None:
        """``rate`` requests a second whatever the answers take (a drain must not slow the arrivals)."""
        tasks = []
        start = time.monotonic()
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(start + i / rate - time.monotonic(), 0))
            tasks.append(asyncio.create_task(self.one()))
        await asyncio.gather(*tasks)


# -- the scenarios --------------------------------------------------------------------------------


@dataclass
class Row:
    fault: str
    repetitions: int
    tally: Tally
    audit: Audit | None
    note: str = ""
    # Requests whose billable ledger row is not on the day the scenario knows (Tally.known_days).
    misdated: list[str] = field(default_factory=list)


async def _in_thread(fn: Callable[..., object], *args: object) -> None:
    await asyncio.to_thread(fn, *args)


async def worker_kill(rig: Rig, reps: int) -> Clients:
    """Two workers, 8 clients (80 % streaming, 8 tokens 20 ms apart on the instant engine): every
    0.4 s one worker is killed with its engine (SIGKILL to its process group) and started again.
    Jobs not yet begun are taken over after their 1.5 s lease; begun streams end with worker_lost."""
    clients = Clients(rig, stream_share=0.8)
    stop = asyncio.Event()
    load = asyncio.create_task(clients.closed_loop(8, stop.is_set))
    try:
        for k in range(reps):
            await asyncio.sleep(0.4)  # streams are under way (8 tokens, 20 ms apart)
            rig.kill_worker(k % rig.workers)
            await _in_thread(rig.restart_worker, k % rig.workers)
        await asyncio.sleep(3)  # the last takeovers
    finally:
        stop.set()
        await load
        await clients.close()
    return clients


async def sigterm_drain(rig: Rig, reps: int) -> Clients:
    """Two workers, 50 requests a second open-loop (each holds a worker 0.6 s), 6 s a repetition:
    2 s in, one worker gets SIGTERM; it finishes what it holds and takes nothing new."""
    clients = Clients(rig, stream_share=0.5)
    for rep in range(reps):
        load = asyncio.create_task(clients.open_loop(50, 6))
        await asyncio.sleep(2)
        rig.kill_worker(0, signal.SIGTERM)
        await _in_thread(rig.worker_procs[0].process.wait)  # type: ignore[union-attr]
        await load
        if rep < reps - 1:  # for the next repetition (after the last, nothing is sent)
            await _in_thread(rig.restart_worker, 0)
    await clients.close()
    return clients


async def _under_load(rig: Rig, reps: int, concurrency: int, settle_s: float, fault: Callable[[], object],
                      mend: Callable[[], object] = lambda: None, down_s: float = 0.0, after_s: float = 4.0,
                      stream_share: float = 0.5) -> Clients:
    """``reps`` times: clients send for ``settle_s``, then ``fault``, ``down_s`` later ``mend`` (both in
    a thread), and they go on for ``after_s`` before the next repetition."""
    clients = Clients(rig, stream_share=stream_share)
    for _ in range(reps):
        stop = asyncio.Event()
        load = asyncio.create_task(clients.closed_loop(concurrency, stop.is_set))
        await asyncio.sleep(settle_s)
        await _in_thread(fault)
        await asyncio.sleep(down_s)
        await _in_thread(mend)
        await asyncio.sleep(after_s)
        stop.set()
        await load
    await clients.close()
    return clients


async def gateway_kill(rig: Rig, reps: int) -> Clients:
    """Two gateway processes, 16 clients spread over them (each request holds a worker ~0.45 s): 2 s
    in, one gateway gets SIGKILL with requests in flight; its clients move to the other, as a load
    balancer's would; 2 s later it is started again. The reaper settles what it held (dead after 3 s)."""
    return await _under_load(rig, reps, 16, 2, lambda: rig.kill_gateway(0), lambda: rig.start_gateway(0),
                             down_s=2, after_s=0)


async def redis_restart(rig: Rig, reps: int) -> Clients:
    """8 clients; 2 s in, Redis is shut down (SIGTERM: the append-only file is synced), started
    again on it 1 s later, and the clients go on 4 s."""
    assert rig.redis is not None
    return await _under_load(rig, reps, 8, 2, rig.redis.stop, rig.redis.start, down_s=1)


async def redis_loss(rig: Rig, reps: int) -> Clients:
    """A plan limit of 200 a day, 16 clients on two workers that hold 2 jobs each (so jobs queue in
    Redis); 1.5 s in, Redis is killed (SIGKILL), its files deleted, and started empty: the counters are
    rebuilt from the ledger and the day's limit must hold; the jobs lost with the data are answered
    503 job_lost within seconds (the request timeout is 60 s, the clients give up at 30 s)."""
    assert rig.redis is not None
    redis = rig.redis

    def lose() -> None:
        redis.process.kill()  # type: ignore[union-attr]
        redis.process.wait()  # type: ignore[union-attr]
        shutil.rmtree(redis.directory, ignore_errors=True)

    return await _under_load(rig, reps, 16, 1.5, lose, redis.start, after_s=6)


async def postgres_stop(rig: Rig, reps: int) -> Clients:
    """A private PostgreSQL cluster (bench.postgres), 8 clients; 2 s in, it is stopped (a fast shutdown:
    SIGINT) and started 3 s later; the gateway must answer 503 meanwhile and recover without a restart."""
    assert rig.pg is not None
    return await _under_load(rig, reps, 8, 2, rig.pg.pause, rig.pg.resume, down_s=3)


async def stripe_failing(rig: Rig, reps: int) -> Clients:
    """8 clients for 2.5 s a repetition while Stripe's edge answers 30 % of meter events with 500/503
    and holds 10 % of its answers 2 s past the sender's 1 s timeout (after recording the event)."""
    assert rig.edge is not None
    rig.edge.failure_rate, rig.edge.lost_answer_rate, rig.edge.hold_s = 0.3, 0.1, 2.0
    clients = Clients(rig, stream_share=0.5)
    deadline = time.monotonic() + 2.5 * reps
    await clients.closed_loop(8, lambda: time.monotonic() > deadline)
    await clients.close()
    return clients


async def day_boundary(rig: Rig, reps: int) -> Clients:
    """Two gateways (and the workers) on clocks moved by libfaketime, the second 1.5 s ahead of the
    first. They start after midnight, however long that takes; once all run, their clocks are set back
    to 4 s (the first) and 2.5 s (the second) before it and held there while 8 clients send 2
    requests each, however long those take; then the clocks run on, and the clients go on until each
    has had an answer to a request sent once both clocks had passed midnight."""
    assert rig.clock_offsets_s is not None
    # Back, not forward: a clock moved forward would find every other process's last heartbeat old
    # (a gateway would be reaped, a worker taken for dead) until each had beaten again. Held, then let
    # run from where it stood: a slow machine takes longer, never more of the day.
    first = rig.clock_offsets_s[0]
    # The midnight the first clock passed at the start (not the real clock's next one, which the
    # start may have passed too).
    midnight = _day_start(datetime.now(UTC) + timedelta(seconds=first))
    before, after = f"{midnight - timedelta(days=1):%Y-%m-%d}", f"{midnight:%Y-%m-%d}"
    leads_s = [4.0 - (offset - first) for offset in rig.clock_offsets_s]  # before midnight, per gateway
    held = [midnight - timedelta(seconds=lead) for lead in leads_s]
    rig.hold_clocks(held)
    clients = Clients(rig, stream_share=0.5)

    async def held_client() -> None:
        for _ in range(2 * reps):
            request_id = await clients.one()
            if request_id is not None:
                clients.tally.known_days[request_id] = before

    await asyncio.gather(*(held_client() for _ in range(8)))
    # Let every clock run from where it stands; from ``past`` on, every clock reads after midnight.
    released = time.time()
    rig.set_clock_offsets([at.timestamp() - released for at in held])
    past = released + max(leads_s)
    give_up = time.monotonic() + 120

    async def crossing_client() -> None:
        while time.monotonic() < give_up:
            sent = time.time()
            request_id = await clients.one()
            if request_id is not None and sent >= past:
                clients.tally.known_days[request_id] = after
                return

    await asyncio.gather(*(crossing_client() for _ in range(8)))
    await clients.close()
    return clients


def _day_start(at: datetime) -> datetime:
    """The UTC midnight that begins ``at``'s day (the plans' quota day is UTC's)."""
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


def _to_midnight(lead_s: float) -> float:
    """The clock offset that puts a gateway ``lead_s`` seconds before the next UTC midnight."""
    now = datetime.now(UTC)
    return (_day_start(now) + timedelta(days=1) - now).total_seconds() - lead_s


@dataclass
class Scenario:
    name: str
    fault: str
    run: Callable[[Rig, int], object]
    rig: dict[str, object]
    bench_reps: int
    test_reps: int
    # What the row does, where the run function's docstring does not say it.
    about: str = ""
    # Rig options of the tests' runs (run_scenario's ``quick``) over ``rig``: waits shortened where the
    # check does not need their length.
    test_rig: dict[str, object] = field(default_factory=dict)


SCENARIOS = [
    Scenario("worker_kill", "worker kill -9 mid-stream (2 workers)", worker_kill, {"workers": 2}, 100, 3),
    Scenario("worker_kill_cpu", "worker kill -9 mid-stream, real CPU engine (2 workers)", worker_kill,
             {"workers": 2, "engine": "vllm"}, 3, 0,
             about="The same kills (every 0.4 s, 8 clients, 80 % streaming), with workers running the real vLLM "
                   "engine on the CPU (SmolLM2-135M, eager mode, 8 tokens a request)."),
    Scenario("sigterm_drain", "worker SIGTERM drain at 50 req/s", sigterm_drain,
             {"workers": 2, "shape": Shape(tokens=8, first_token_delay_s=0.2, token_delay_s=0.05)}, 3, 1),
    Scenario("gateway_kill", "gateway kill -9 with requests in flight (2 gateways)", gateway_kill,
             {"gateways": 2, "shape": Shape(tokens=8, first_token_delay_s=0.05, token_delay_s=0.05)}, 3, 1),
    Scenario("redis_restart", "Redis restarted (AOF on)", redis_restart, {"persist_redis": True}, 3, 1),
    Scenario("redis_loss", "Redis lost (data gone), limit 200/day", redis_loss,
             {"daily_limit": 200, "request_timeout_s": 60.0, "max_inflight": 2,
              "shape": Shape(tokens=8, token_delay_s=0.05)}, 2, 1),
    Scenario("postgres_stop", "PostgreSQL stopped 3 s and started", postgres_stop, {"postgres": True}, 2, 1),
    # The tests' sender gives up on Stripe after 0.25 s, not 1 s (the edge holds a lost answer 2 s, past
    # either), and backs off 1 s at most: a lost answer costs it a quarter as long, and the last retries
    # wait 1 s, not 4 s.
    Scenario("stripe_failing", "Stripe 5xx (30 %) and lost answers (10 %)", stripe_failing, {}, 2, 1,
             test_rig={"stripe_timeout_s": 0.25, "outbox_max_backoff_s": 1.0}),
    Scenario("day_boundary", "midnight crossed, two gateways 1.5 s apart", day_boundary,
             {"gateways": 2, "clock_offsets_s": "midnight"}, 1, 1),
]


def run_scenario(scenario: Scenario, workdir: Path, reps: int, *, quick: bool = False) -> Row:
    """Run ``scenario`` ``reps`` times on a rig of its own; ``quick``: the tests' run (its ``test_rig``)."""
    options = {**scenario.rig, **(scenario.test_rig if quick else {})}
    if options.get("clock_offsets_s") == "midnight":  # day_boundary sets them back once all runs
        options["clock_offsets_s"] = [_to_midnight(0.0), _to_midnight(0.0) + 1.5]
    with_services = Services()
    rig = Rig(workdir, with_services, **options)  # type: ignore[arg-type]
    try:
        try:
            rig.start()
        except Unavailable as exc:
            return Row(scenario.fault, 0, Tally(), None, note=f"not run: {exc}")
        try:
            clients = asyncio.run(scenario.run(rig, reps))  # type: ignore[arg-type]
        except RuntimeError as exc:  # a part that did not start again: the row says so
            return Row(scenario.fault, reps, Tally(), rig.audit(), note=f"failed: {str(exc)[:300]}")
        audit = rig.settle(90.0)
        tally: Tally = clients.tally  # type: ignore[union-attr]
        row = Row(scenario.fault, reps, tally, audit, misdated=_misdated(rig, tally.known_days))
        if tally.known_days:
            on = Counter(tally.known_days.values())
            row.note = (", ".join(f"{n} requests sent for {day}" for day, n in sorted(on.items()))
                        + f" (known by the clocks): {len(row.misdated) or 'none'} billed on another day")
        return row
    finally:
        rig.stop()


# -- the report -----------------------------------------------------------------------------------

COLUMNS = ["fault", "reps", "sent", "answered", "failed cleanly", "cut", "lost", "billed twice", "sent twice",
           "units counted", "ledger billable", "given back", "unaccounted", "outbox", "Stripe kept",
           "Stripe missing / extra", "Stripe calls", "open rows", "ok", "commit"]


def _cells(row: Row, commit: str) -> list[str]:
    tally, audit = row.tally, row.audit
    failed = sum(tally.failed.values())
    codes = ", ".join(f"{code} x{n}" for code, n in tally.failed.most_common())
    if audit is None:
        return [row.fault, "0", *(["-"] * (len(COLUMNS) - 4)), row.note, commit]
    return [row.fault, str(row.repetitions), str(tally.sent), str(tally.answered),
            f"{failed}" + (f" ({codes})" if codes else ""), str(tally.cut), str(tally.lost),
            str(len(audit.billed_twice)), str(sum(audit.sent_twice.values())), _by_day(audit.counted_by_day),
            _by_day(audit.billable_by_day), str(audit.given_back), str(sum(abs(n) for n in audit.unaccounted.values())),
            str(audit.outbox), str(audit.stripe_events), f"{len(audit.stripe_missing)} / {len(audit.stripe_extra)}",
            f"{audit.stripe_calls}" + (f" ({audit.stripe_replays} replays)" if audit.stripe_replays else ""),
            str(audit.open_rows), "yes" if _ok(row) else "NO", commit]


def _ok(row: Row) -> bool:
    tally, audit = row.tally, row.audit
    # Where the scenario knows days, each day billed is one it sent for (day_boundary: both were reached).
    days = not tally.known_days or (audit is not None and set(tally.known_days.values()) == set(audit.billable_by_day))
    return audit is not None and tally.answered > 0 and tally.lost == 0 and audit.clean and not row.misdated and days


def _misdated(rig: Rig, known_days: dict[str, str]) -> list[str]:
    """The requests of ``known_days`` whose billable ledger row is missing or on another day."""
    if not known_days:
        return []
    billed = {str(rid): str(day) for rid, day in rig.sql("SELECT id, quota_day FROM requests WHERE billable")}
    return [f"{rid or '(no x-request-id)'}: billed on {billed.get(rid)}, sent for {day}"
            for rid, day in sorted(known_days.items()) if billed.get(rid) != day]


def _by_day(by_day: dict[str, int]) -> str:
    if len(by_day) <= 1:
        return str(sum(by_day.values()))
    return " + ".join(f"{n} ({day})" for day, n in sorted(by_day.items()))


def write(rows: list[Row], out: Path, commit: str, *, merge: bool) -> None:
    """faults.csv and faults.md; with ``merge``, the rows of scenarios not run now stay as they were
    (each row names the commit it ran at)."""
    out.mkdir(parents=True, exist_ok=True)
    cells = {row.fault: _cells(row, commit) for row in rows}
    if merge and (out / "faults.csv").exists():
        with (out / "faults.csv").open(newline="") as handle:
            kept = {line[0]: line for line in list(csv.reader(handle))[1:] if len(line) == len(COLUMNS)}
        cells = {**kept, **cells}
    ordered = [cells[s.fault] for s in SCENARIOS if s.fault in cells]
    with (out / "faults.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(ordered)
    lines = [HEADER.format(date=f"{datetime.now(UTC):%Y-%m-%d}", cores=os.cpu_count()), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(line) + " |" for line in ordered]
    lines += ["", "What each row does (bench/faults.py):"]
    lines += [f"- {s.fault}: {s.about or ' '.join((s.run.__doc__ or '').split())}" for s in SCENARIOS
              if s.fault in cells]
    notes = [f"- {row.fault}: {row.note}" for row in rows if row.note and row.audit is not None]
    if notes:
        lines += ["", *notes]
    lost = [f"- {row.fault}: {example}" for row in rows for example in row.tally.lost_examples]
    if lost:
        lines += ["", "Lost requests (first few):", *lost]
    (out / "faults.md").write_text("\n".join(lines) + "\n")


HEADER = ("# Faults under load\n\n`python -m bench faults`, {date}, {cores} cores (see bench/faults.py for each "
          "scenario's load and fault, bench/audit.py for each account of the money; the commit column says which "
          "code each row ran). lost = no answer and no clean error; cut = the connection of a killed gateway; "
          "billed twice = request ids with more than one billable ledger row; sent twice = meter events sent "
          "again for an identifier Stripe had kept (Stripe refuses them; its edge records every call); given "
          "back = rows closed free, whose units went back; unaccounted = quota units counted in Redis minus "
          "billable rows, per account and day; Stripe missing / extra = billable requests Stripe never kept / "
          "meter events for requests not billable; replays = retries under the same Idempotency-Key after a "
          "lost answer (Stripe answers them again, billing nothing new). ok = some answered, 0 lost, 0 billed "
          "twice, 0 sent twice, 0 unaccounted, 0 missing, 0 extra, counted = ledger = outbox = Stripe, no open row.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="*", choices=[s.name for s in SCENARIOS],
                        help="run these scenarios only (the other rows of the table stay)")
    parser.add_argument("--quick", action="store_true",
                        help="the tests' repetitions and rig options instead of the bench's")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flatfare-faults"))
    parser.add_argument("--out", type=Path, default=RESULTS)


def run(args: argparse.Namespace) -> int:
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                            check=False, text=True).stdout.strip()
    rows = []
    shutil.rmtree(args.workdir, ignore_errors=True)
    for scenario in SCENARIOS:
        if args.only and scenario.name not in args.only:
            continue
        reps = scenario.test_reps if args.quick else scenario.bench_reps
        print(f"{scenario.name}: {scenario.fault}, {reps} repetitions", flush=True)
        started = time.monotonic()
        row = run_scenario(scenario, args.workdir / scenario.name, reps, quick=args.quick)
        print("  " + " | ".join(_cells(row, commit)) + f"  ({time.monotonic() - started:.0f} s)", flush=True)
        rows.append(row)
    write(rows, args.out, commit, merge=bool(args.only))
    return 0 if all(r.audit is None or _ok(r) for r in rows) else 1
