"""bench.fleet's stack: Flatfare with no worker of its own, a catalog of on-demand models and one
``flatfare fleet`` with a budget of one awake engine; what the fleet and the workers say in Redis, and the
ledger."""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_py

from bench.procs import Service, Services, free_port
from bench.stack import FlatfareStack, http_get
from flatfare import contract
from flatfare.contract import FleetStatus, WorkerInfo

FLEET_ID = "bench"
# A request waits for its model this long at most (the gateway's cold-start bound): a CPU start under load.
COLD_START_TIMEOUT_S = 900
# Seconds a settled fleet may take to show every engine warm or asleep after an answer.
SETTLE_S = 180.0
# The fleet lets its workers drain this long at exit; the bench waits a little longer for it.
FLEET_STOP_TIMEOUT_S = 60


@dataclass
class FleetBench:
    """A Flatfare stack with no worker of its own, a catalog of on-demand models and one fleet."""

    group: Services
    workdir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    stack: FlatfareStack = field(init=False)
    gateway: Service | None = None
    fleet: Service | None = None
    port: int = 0

    def __post_init__(self) -> None:
        env = {"FLATFARE_COLD_START_TIMEOUT_S": str(COLD_START_TIMEOUT_S), "VLLM_NO_USAGE_STATS": "1",
               **self.env_extra}
        self.stack = FlatfareStack(self.group, self.workdir, "", extra_env=env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db_path(self) -> Path:
        return self.workdir / "flatfare.db"

    def start(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)  # a fresh catalog, ledger and logs every run
        self.stack.start_storage()
        self.port = free_port()
        self.gateway = self.group.start(Service(
            "gateway", [sys.executable, "-m", "flatfare", "gateway", "--port", str(self.port)],
            self.workdir / "gateway.log", env=self.stack.env(), cwd=str(self.workdir)))
        self.gateway.wait_ready(lambda: http_get(f"{self.base_url}/healthz")[0] == 200, 120)

    def catalog(self, entries: dict[str, tuple[str, dict[str, Any]]]) -> None:
        """Make exactly ``entries`` (name -> source, options) the enabled catalog, all on demand. Options
        pass the admin API's own validation first, so a typo fails here, not in a worker."""
        from flatfare.gateway.admin.model_options import EngineOptions

        rows = [(name, source, json.dumps(EngineOptions.model_validate(options).as_options()))
                for name, (source, options) in entries.items()]
        with sqlite3.connect(self.db_path) as db:
            db.execute("UPDATE models SET enabled = 0, pinned = 0, min_workers = 0")
            for name, source, options in rows:
                db.execute("INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers) "
                           "VALUES (?, ?, ?, 1, 0, 0) ON CONFLICT (name) DO UPDATE SET source = excluded.source, "
                           "engine_options = excluded.engine_options, enabled = 1", (name, source, options))

    def entry(self, name: str) -> tuple[str, dict[str, Any]]:
        with sqlite3.connect(self.db_path) as db:
            source, options = db.execute("SELECT source, engine_options FROM models WHERE name = ?",
                                         (name,)).fetchone()
        return source, json.loads(options or "{}")

    def start_fleet(self, models: list[str], *args: str) -> Service:
        argv = [sys.executable, "-m", "flatfare", "fleet", "--max-awake", "1", "--on-demand",
                "--idle-timeout", "86400", "--metrics-port", "-1", *args]
        for model in models:
            argv += ["--model", model]
        env = {**self.stack.env(), "FLATFARE_FLEET_ID": FLEET_ID,
               "FLATFARE_FLEET_STOP_TIMEOUT_S": str(FLEET_STOP_TIMEOUT_S)}
        self.fleet = self.group.start(Service("fleet", argv, self.workdir / "fleet.log", env=env,
                                              cwd=str(self.workdir)))
        self.fleet.wait_ready(lambda: self.status() is not None, 120)
        return self.fleet

    def stop(self) -> None:
        """The fleet first, given time to let its workers drain (they need Redis to leave their pools)."""
        if self.fleet is not None:
            self.fleet.stop(FLEET_STOP_TIMEOUT_S + 30)
        self.stack.stop()

    def redis(self) -> redis_py.Redis:
        assert self.stack.redis is not None
        return redis_py.Redis.from_url(self.stack.redis.url)

    def status(self) -> FleetStatus | None:
        with self.redis() as client:
            raw = client.get(contract.fleet_key(FLEET_ID))
        return FleetStatus.decode(raw) if raw else None

    def heartbeats(self, models: list[str]) -> list[WorkerInfo]:
        """The live workers of ``models``' pools, as their heartbeats say."""
        oldest = int((time.time() - contract.WORKER_TTL_S) * 1000)
        with self.redis() as client:
            ids = [w for m in models for w in client.zrangebyscore(contract.pool_key(m), oldest, "+inf")]
            return [WorkerInfo.from_fields(f) for f in (client.hgetall(contract.worker_key(w.decode())) for w in ids)
                    if f]

    def facts(self, model: str) -> dict[str, Any]:
        with self.redis() as client:
            facts = contract.ModelFacts.from_fields(client.hgetall(contract.model_facts_key(model)))
        return {"start_s": facts.start_s, "wake_s": facts.wake_s, "max_model_len": facts.max_model_len}

    def settle(self, after_ms: int) -> FleetStatus | None:
        """The fleet's first status newer than ``after_ms`` with every engine warm or asleep (or the last
        one seen, past SETTLE_S): each request is measured from a quiet fleet."""
        deadline = time.monotonic() + SETTLE_S
        status = self.status()
        while time.monotonic() < deadline:
            if status is not None and status.updated_ms > after_ms and all(
                    e["state"] in ("warm", "asleep") for e in status.engines.values()):
                return status
            time.sleep(0.2)
            status = self.status()
        return status

    def ledger(self, request_ids: list[str]) -> dict[str, tuple[str, int | None]]:
        """Each request's ledger row (status, HTTP status), once every one is final or after 60 s."""
        deadline = time.monotonic() + 60
        while True:
            with sqlite3.connect(self.db_path) as db:
                rows = {r[0]: (r[1], r[2]) for r in db.execute(
                    f"SELECT id, status, http_status FROM requests WHERE id IN ({','.join('?' * len(request_ids))})",
                    request_ids)}
            if all(rows.get(i, ("queued",))[0] != "queued" for i in request_ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)
