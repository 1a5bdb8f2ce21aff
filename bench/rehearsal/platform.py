"""The platform the rehearsal runs on, as an operator runs it: a private Redis, the SQL ledger (SQLite, or
a private PostgreSQL), Stripe's edge (bench.stripe_edge: meter events kept once per identifier, every call
recorded), ``flatfare gateway`` with N processes, and one ``flatfare fleet`` serving the catalog's main
model (pinned: kept up) and a second one on demand (its engine sleeps after ``idle_timeout_s`` and wakes
for its next request). Accounts and keys are made through the admin API; only their Stripe customer ids
are written in SQL, as Checkout's webhook would have. What it runs on is read from Redis and /proc."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import redis as redis_py

from bench.audit import audit, read_books
from bench.procs import Service, Services, free_port
from bench.rehearsal.schedule import Account, Send
from bench.stack import FlatfareStack, http_get, http_post
from bench.stripe_edge import StripeEdge
from flatfare import contract
from flatfare.contract import FleetStatus, WorkerInfo

FLEET_ID = "rehearsal"


@dataclass(frozen=True, slots=True)
class Model:
    """A catalog entry: the name clients ask for, where its weights are, its engine options."""

    name: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)
    pinned: bool = False
    idle_timeout_s: int | None = None


@dataclass
class Platform:
    group: Services
    workdir: Path
    main: Model
    second: Model | None = None
    gateway_processes: int = 2
    gpus: str = "cpu"  # the fleet's --gpus
    max_awake: int = 2
    env_extra: dict[str, str] = field(default_factory=dict)
    stack: FlatfareStack = field(init=False)
    edge: StripeEdge | None = None
    gateway: Service | None = None
    fleet: Service | None = None
    port: int = 0
    admin_token: str = ""

    def __post_init__(self) -> None:
        self.stack = FlatfareStack(self.group, self.workdir, self.main.name, extra_env=self.env_extra)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def models(self) -> list[Model]:
        return [self.main, *([self.second] if self.second else [])]

    @property
    def database_url(self) -> str:
        return self.stack.env()["FLATFARE_DATABASE_URL"]

    def env(self) -> dict[str, str]:
        assert self.edge is not None
        return {**self.stack.env(), "FLATFARE_STRIPE_API_KEY": "sk_test_rehearsal",
                "FLATFARE_STRIPE_WEBHOOK_SECRET": "whsec_rehearsal", "FLATFARE_STRIPE_API_BASE": self.edge.url,
                "FLATFARE_STRIPE_TIMEOUT_S": "5", "FLATFARE_BILLING_OUTBOX_INTERVAL_S": "0.5",
                "FLATFARE_COLD_START_TIMEOUT_S": "600", "VLLM_NO_USAGE_STATS": "1", **self.env_extra}

    # -- start and stop ---------------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 900) -> float:
        """Everything up, the main model's engine warm and answering; the seconds it took."""
        started = time.monotonic()
        self.edge = StripeEdge(seed=32).start()
        self.stack.start_storage()
        self._catalog()
        self.port = free_port()
        self.gateway = self.group.start(Service(
            "gateway", [sys.executable, "-m", "flatfare", "gateway", "--port", str(self.port), "--processes",
                        str(self.gateway_processes)], self.workdir / "gateway.log", env=self.env(),
            cwd=str(self.workdir)))
        self.gateway.wait_ready(lambda: http_get(f"{self.base_url}/healthz")[0] == 200, 120)
        argv = [sys.executable, "-m", "flatfare", "fleet", "--max-awake", str(self.max_awake), "--gpus", self.gpus,
                "--metrics-port", "-1"]
        for model in self.models:
            argv += ["--model", model.name]
        self.fleet = self.group.start(Service("fleet", argv, self.workdir / "fleet.log",
                                              env={**self.env(), "FLATFARE_FLEET_ID": FLEET_ID},
                                              cwd=str(self.workdir)))

        def answers() -> bool:
            status, _ = http_post(f"{self.base_url}/v1/chat/completions", self.stack.key,
                                  {"model": self.main.name, "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "Hi"}]}, timeout_s=60)
            return status == 200

        self.fleet.wait_ready(answers, ready_timeout_s, [self.gateway])
        if self.second is not None:  # its first start (a cold one) before anything is measured; then it idles
            status, raw = http_post(f"{self.base_url}/v1/chat/completions", self.stack.key,
                                    {"model": self.second.name, "max_tokens": 1,
                                     "messages": [{"role": "user", "content": "Hi"}]}, timeout_s=ready_timeout_s)
            if status != 200:
                raise RuntimeError(f"the second model did not answer its first request: {status} {raw[:300]!r}")
        done = subprocess.run([sys.executable, "-m", "flatfare", "admin", "bootstrap"], env=self.env(), check=True,
                              capture_output=True, text=True, cwd=self.workdir)
        self.admin_token = done.stdout.strip().splitlines()[-1]
        return time.monotonic() - started

    def _catalog(self) -> None:
        """The catalog holds exactly these models, and every plan may use them (Free's seeded list names only
        the built-in model)."""
        from flatfare.gateway.admin.model_options import EngineOptions

        names = [m.name for m in self.models]
        self._sql("UPDATE models SET enabled = 0, pinned = 0, min_workers = 0")
        for model in self.models:
            options = json.dumps(EngineOptions.model_validate(model.options).as_options())
            self._sql("INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers, idle_timeout_s) "
                      "VALUES (?, ?, ?, 1, ?, 0, ?) ON CONFLICT (name) DO UPDATE SET source = excluded.source, "
                      "engine_options = excluded.engine_options, enabled = 1, pinned = excluded.pinned, "
                      "idle_timeout_s = excluded.idle_timeout_s",
                      (model.name, model.source, options, int(model.pinned), model.idle_timeout_s))
        self._sql("UPDATE plans SET allowed_models = ? WHERE allowed_models IS NOT NULL", (json.dumps(names),))

    def price(self, micros: dict[str, int]) -> None:
        """A metered price per request on these plans, set as an operator sets it (the admin API), so that every
        billable request of theirs becomes an outbox row and a Stripe meter event the audit can count."""
        import urllib.request

        for plan, price in micros.items():
            request = urllib.request.Request(
                f"{self.base_url}/admin/v1/plans/{plan}", data=json.dumps({"price_per_request_micros": price}).encode(),
                method="PATCH", headers={"Authorization": f"Bearer {self.admin_token}",
                                         "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"pricing {plan}: {answer.status}")
        self._customers()  # the bench account's too, before it sends anything
        time.sleep(1.0)  # every gateway process re-reads the plans within 0.5 s

    def plans(self) -> dict[str, dict[str, Any]]:
        """Each plan's limits as the database has them: what the clients keep to, and the figures assume."""
        rows = self._sql("SELECT name, daily_limit, max_output_tokens, max_prompt_tokens, max_inflight, lane, "
                         "price_per_request_micros FROM plans")
        return {name: {"daily_limit": daily, "max_output_tokens": out, "max_prompt_tokens": prompt,
                       "max_inflight": inflight, "lane": lane, "price_micros": price}
                for name, daily, out, prompt, inflight, lane, price in rows}

    def _sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        url = self.database_url
        if not url.startswith("sqlite"):
            raise RuntimeError("the rehearsal's platform keeps its ledger in SQLite")
        with sqlite3.connect(url.split("///", 1)[1]) as db:
            return db.execute(query, params).fetchall()

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop(90)
            self.fleet = None
        if self.gateway is not None:
            self.group.stop(self.gateway)
            self.gateway = None
        self.stack.stop()
        if self.edge is not None:
            self.edge.stop()
            self.edge = None

    # -- accounts, batches --------------------------------------------------------------------------

    async def accounts(self, prefix: str, book: dict[int, Account]) -> dict[int, str]:
        """One account per rank on its plan, with one key each (through the admin API); rank -> key."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        keys: dict[int, str] = {}
        gate = asyncio.Semaphore(4)  # SQLite takes one write at a time
        async with aiohttp.ClientSession(headers=headers) as session:
            async def one(account: Account) -> None:
                async with gate:
                    url = f"{self.base_url}/admin/v1/accounts"
                    async with session.post(url, json={"name": f"{prefix}-{account.rank}", "plan": account.plan}) as r:
                        made = await r.json()
                        if r.status != 201:
                            raise RuntimeError(f"account {prefix}-{account.rank}: {r.status} {made}")
                    async with session.post(f"{url}/{made['id']}/keys", json={"name": prefix}) as r:
                        keys[account.rank] = (await r.json())["key"]

            await asyncio.gather(*(one(a) for a in book.values()))
        self._customers()
        return keys

    def _customers(self) -> None:
        """Every account's Stripe customer, as Checkout's webhook would have set it: each billable request of a
        priced plan goes to Stripe as a meter event (one sent before its account had a customer is skipped)."""
        self._sql("UPDATE accounts SET stripe_customer_id = 'cus_' || id WHERE stripe_customer_id IS NULL")

    async def submit_batches(self, keys: dict[int, str],
                             lines: dict[int, list[dict[str, Any]]]) -> list[tuple[int, str]]:
        """One batch file per account (rank -> its lines' chat bodies); (rank, batch id) each."""
        made = []
        async with aiohttp.ClientSession() as session:
            for rank, bodies in lines.items():
                if not bodies:
                    continue
                headers = {"Authorization": f"Bearer {keys[rank]}"}
                data = "".join(json.dumps({"custom_id": f"r{rank}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                           "body": b}) + "\n" for i, b in enumerate(bodies))
                form = aiohttp.FormData()
                form.add_field("purpose", "batch")
                form.add_field("file", data.encode(), filename="lines.jsonl", content_type="application/jsonl")
                async with session.post(f"{self.base_url}/v1/files", data=form, headers=headers) as r:
                    uploaded = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"batch file of rank {rank}: {r.status} {uploaded}")
                async with session.post(f"{self.base_url}/v1/batches", headers=headers, json={
                        "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                        "completion_window": "24h"}) as r:
                    batch = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"batch of rank {rank}: {r.status} {batch}")
                made.append((rank, batch["id"]))
        return made

    async def batch_state(self, keys: dict[int, str], batches: list[tuple[int, str]],
                          cancel: bool = False) -> list[dict[str, Any]]:
        out = []
        async with aiohttp.ClientSession() as session:
            for rank, batch_id in batches:
                headers = {"Authorization": f"Bearer {keys[rank]}"}
                method, path = (("POST", f"/v1/batches/{batch_id}/cancel") if cancel
                                else ("GET", f"/v1/batches/{batch_id}"))
                async with session.request(method, self.base_url + path, headers=headers) as r:
                    out.append(await r.json())
        return out

    # -- what it runs on ------------------------------------------------------------------------------

    def redis(self) -> redis_py.Redis:
        assert self.stack.redis is not None
        return redis_py.Redis.from_url(self.stack.redis.url)

    def workers(self) -> list[WorkerInfo]:
        oldest = int((time.time() - contract.WORKER_TTL_S) * 1000)
        with self.redis() as client:
            ids = [w for m in self.models for w in client.zrangebyscore(contract.pool_key(m.name), oldest, "+inf")]
            return [WorkerInfo.from_fields(f) for f in (client.hgetall(contract.worker_key(w.decode())) for w in ids)
                    if f]

    def fleet_status(self) -> FleetStatus | None:
        with self.redis() as client:
            raw = client.get(contract.fleet_key(FLEET_ID))
        return FleetStatus.decode(raw) if raw else None

    def sample(self) -> dict[str, Any]:
        """Memory of each part, Redis's memory and keys, the main engine's governor and the engines' states."""
        out: dict[str, Any] = {"t": time.time()}
        if self.gateway is not None and self.gateway.alive():  # its master and worker processes
            out["gateway_rss_mib"] = _tree_rss_mib(self.gateway.pid)
        if self.fleet is not None and self.fleet.alive():  # the supervisor alone: its workers are counted apart
            out["fleet_rss_mib"] = _tree_rss_mib(self.fleet.pid, children=False)
        if self.stack.redis is not None and self.stack.redis.process is not None:
            out["redis_rss_mib"] = _tree_rss_mib(self.stack.redis.process.pid)
        with self.redis() as client:
            info = client.info("memory")
            out["redis_used_mib"] = round(info["used_memory"] / 2**20, 2)
            out["redis_keys"] = client.dbsize()
        for worker in self.workers():
            prefix = "main" if worker.model == self.main.name else "second"
            out[f"{prefix}_state"] = worker.state.value
            out[f"{prefix}_inflight"] = worker.inflight
            if worker.extra.get("governor"):
                out[f"{prefix}_governor"] = worker.extra["governor"]
        status = self.fleet_status()
        if status is not None:
            for engine in status.engines.values():
                prefix = "main" if engine["model"] == self.main.name else "second"
                out[f"{prefix}_engine"] = engine["state"]
                if engine.get("pid"):
                    out[f"{prefix}_worker_rss_mib"] = _tree_rss_mib(int(engine["pid"]))
        return out

    def outbox_settled(self) -> bool:
        rows = self._sql("SELECT count(*) FROM usage_outbox WHERE status NOT IN ('sent', 'skipped')")
        open_rows = self._sql("SELECT count(*) FROM requests WHERE status = 'queued'")
        return rows[0][0] == 0 and open_rows[0][0] == 0

    def audit(self) -> dict[str, Any]:
        assert self.edge is not None and self.stack.redis is not None
        books = audit(read_books(self.database_url, self.stack.redis.url, self.edge.received))
        return {"faults": books.faults(), "rows": books.rows, "billable_live": books.billable,
                "billed": books.billed, "units_counted": books.counted, "units_given_back": books.given_back,
                "outbox": books.outbox, "outbox_sent": books.outbox_sent, "stripe_events": books.stripe_events,
                "stripe_calls": books.stripe_calls, "charged_twice": books.charged_twice}


def _tree_rss_mib(pid: int, children: bool = True) -> float | None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)] if children else [root]
        return round(sum(p.memory_info().rss for p in tree) / 2**20, 1)
    except psutil.Error:
        return None


def batch_lines(sends: list[Send], model: str, words: Any, max_tokens: Any, seed: int,
                prompt_tokens: Any = None) -> dict[int, list[dict[str, Any]]]:
    """The schedule's batch lines as chat bodies, per account; ``prompt_tokens(send)``: a line's prompt length
    (default: the trace's), so that ``--prompt-scale`` shortens the lines as it does the live requests (a CPU
    run took a line at a time for seconds each, one longer than the model's context)."""
    import random

    rng = random.Random(seed)
    lines: dict[int, list[dict[str, Any]]] = {}
    for send in sends:
        if send.batch:
            tokens = prompt_tokens(send) if prompt_tokens is not None else send.prompt_tokens
            lines.setdefault(send.rank, []).append(
                {"model": model, "messages": [{"role": "user", "content": words.prompt(tokens, rng)}],
                 "max_tokens": max_tokens(send), "ignore_eos": True})
    return lines
