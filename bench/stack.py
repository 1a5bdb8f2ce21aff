"""Flatfare's full path, started the way an operator would: private Redis, SQLite, migrate, a key,
``flatfare worker`` and ``flatfare gateway``, each its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import Service, Services, free_port, pinned
from flatfare.redis_local import LocalRedis


def _pin_all_threads(pid: int, cpus: str | None) -> None:
    if cpus is not None:
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=False, stdout=subprocess.DEVNULL)


def _admin(server_url: str, statement: str) -> None:
    import asyncio

    import asyncpg

    async def go() -> None:
        connection = await asyncpg.connect(server_url)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(go())


class TempPostgres:
    """A database of its own on a PostgreSQL server, created for one run and dropped after it."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.name = f"ff_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"

    @property
    def url(self) -> str:
        from sqlalchemy.engine import make_url

        return make_url(self.server_url).set(database=self.name).render_as_string(hide_password=False)

    def create(self) -> TempPostgres:
        _admin(self.server_url, f'CREATE DATABASE "{self.name}"')
        return self

    def drop(self) -> None:
        _admin(self.server_url, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def http_get(url: str, key: str = "", timeout_s: float = 3.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, key: str, body: dict, timeout_s: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class FlatfareStack:
    """Redis + SQLite + one worker + one gateway process under ``workdir``."""

    services: Services
    workdir: Path
    model: str
    worker_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    gateway_cpus: str | None = None
    worker_cpus: str | None = None
    redis_cpus: str | None = None
    python: str = sys.executable
    gateway_processes: int = 1
    # Empty: a SQLite file in workdir. Else a PostgreSQL server URL; a temporary database is made there.
    postgres_server: str = ""
    postgres: TempPostgres | None = None
    redis: LocalRedis | None = None
    gateway: Service | None = None
    worker: Service | None = None
    key: str = ""
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        assert self.redis is not None
        env = dict(os.environ)
        env.update({
            "FLATFARE_DATA_DIR": str(self.workdir),
            "FLATFARE_DATABASE_URL": self.postgres.url if self.postgres else
            f"sqlite+aiosqlite:///{self.workdir / 'flatfare.db'}",
            "FLATFARE_REDIS_URL": self.redis.url,
        })  # No checkout on PYTHONPATH: its bare flatfare/ would shadow an installed wheel (the GPU machine's)
        env.update(self.extra_env)
        return env

    def _flatfare(self, *args: str) -> list[str]:
        return [self.python, "-m", "flatfare", *args]

    def start_storage(self) -> None:
        """Redis, migrations and the bench account's key: what both the worker and gateway need."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.postgres_server:
            self.postgres = TempPostgres(self.postgres_server).create()
        self.redis = LocalRedis(self.workdir / "redis", persist=False).start()
        _pin_all_threads(self.redis.process.pid, self.redis_cpus)  # type: ignore[union-attr]
        env = self.env()
        subprocess.run(self._flatfare("migrate"), env=env, check=True, cwd=self.workdir,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        done = subprocess.run(self._flatfare("keys", "create", "--account", "bench", "--plan", "enterprise"),
                              env=env, check=True, cwd=self.workdir, capture_output=True, text=True)
        self.key = done.stdout.strip().splitlines()[-1]

    def add_catalog_entry(self, name: str, source: str, options: dict[str, Any]) -> dict[str, Any]:
        """Validate ``options`` as the admin API does (its EngineOptions) and store the catalog row a worker
        started with ``--model name`` and nothing else reads. Returns the options as stored."""
        script = r"""
import asyncio, json, sys
from flatfare.gateway.admin.model_options import EngineOptions
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import CatalogModel
name, source, raw, url = sys.argv[1:5]
options = EngineOptions.model_validate(json.loads(raw)).as_options()
async def main():
    engine = create_engine(url)
    async with session_factory(engine)() as session, session.begin():
        session.add(CatalogModel(name=name, source=source, engine_options=options, enabled=True, pinned=True))
    await engine.dispose()
asyncio.run(main())
print(json.dumps(options))
"""
        env = self.env()
        done = subprocess.run([self.python, "-c", script, name, source, json.dumps(options),
                               env["FLATFARE_DATABASE_URL"]], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the catalog refused the entry {name!r}: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def start_worker(self, ready_timeout_s: float = 900) -> float:
        """Start the worker; the seconds until it heartbeats in Redis."""
        import redis as redis_py

        from flatfare import contract

        self.worker = self.services.start(Service(
            "worker", pinned(self._flatfare("worker", "--model", self.model, *self.worker_args), self.worker_cpus),
            self.workdir / "worker.log", env=self.env(), cwd=str(self.workdir)))
        client = redis_py.Redis.from_url(self.redis.url)  # type: ignore[union-attr]
        try:
            return self.worker.wait_ready(lambda: bool(client.zcard(contract.pool_key(self.model))), ready_timeout_s)
        finally:
            client.close()

    def start_gateway(self, ready_timeout_s: float = 60) -> float:
        self.port = free_port()
        self.gateway = self.services.start(Service(
            "gateway", pinned(self._flatfare("gateway", "--port", str(self.port), "--processes",
                                             str(self.gateway_processes)), self.gateway_cpus),
            self.workdir / "gateway.log", env=self.env(), cwd=str(self.workdir)))

        def serves_model() -> bool:
            # Ready means a real request gets an answer: a worker may heartbeat while its engine loads.
            status, _ = http_post(f"{self.base_url}/v1/completions", self.key,
                                  {"model": self.model, "prompt": "Hi", "max_tokens": 1})
            return status == 200

        return self.gateway.wait_ready(serves_model, ready_timeout_s, [self.worker] if self.worker else [])

    def pids(self) -> dict[str, int]:
        found: dict[str, int] = {}
        if self.gateway is not None and self.gateway.alive():
            found["gateway"] = self.gateway.pid
        if self.worker is not None and self.worker.alive():
            found["worker"] = self.worker.pid
        if self.redis is not None and self.redis.process is not None:
            found["redis"] = self.redis.process.pid
        return found

    def stop_engine_side(self) -> None:
        """Stop the worker and gateway (Redis and SQLite stay for the next start)."""
        for service in (self.gateway, self.worker):
            if service is not None:
                self.services.stop(service)
        self.gateway = self.worker = None

    def stop(self) -> None:
        self.stop_engine_side()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.postgres is not None:
            self.postgres.drop()
            self.postgres = None


