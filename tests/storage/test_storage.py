"""Tables, migrations, seeds and key storage, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
from alembic import command
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from bench.postgres import PrivatePostgres, postgres_unavailable
from bench.procs import Services
from flatfare.billing.ledger import RETRY_S, Charge, DuplicateIdempotencyKey, Ledger, Outcome
from flatfare.storage.accounts import AccountError, issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.db import alembic_config, create_engine, migrate, session_factory
from flatfare.storage.keys import KEY_PREFIX, hash_key, looks_like_key
from flatfare.storage.models import ApiKey, CatalogModel, Plan, RequestRecord, RequestStatus, UsageOutbox
from tests.conftest import unavailable


async def test_migration_seeds_plans_and_default_model(sessions) -> None:
    async with sessions() as session:
        plans = {p.name: p for p in await session.scalars(select(Plan))}
        model = await session.get(CatalogModel, "smollm2-135m-instruct")
    assert set(plans) == {"free", "pro", "premium", "enterprise", "trial"}
    assert (plans["free"].daily_limit, plans["pro"].daily_limit, plans["premium"].daily_limit) == (60, 1000, 5000)
    assert plans["premium"].lane == "premium" and plans["free"].lane == "standard"
    assert plans["enterprise"].daily_limit is None
    assert plans["trial"].trial_days == 7
    assert {name: plan.max_inflight for name, plan in plans.items()} == \
        {"free": 4, "trial": 16, "pro": 16, "premium": 64, "enterprise": None}
    assert model is not None and model.pinned and model.enabled
    assert model.source == "builtin:smollm2-135m-instruct"
    assert model.engine_options["max_model_len"] == 2048


async def test_keys_are_stored_only_as_hash_and_prefix(sessions) -> None:
    async with sessions() as session:
        account = await ensure_account(session, "acme", "pro")
        issued = await issue_key(session, account, "ci")
        await session.commit()
        stored = await session.get(ApiKey, issued.key_id)
    assert looks_like_key(issued.secret) and issued.secret.startswith(KEY_PREFIX)
    assert stored.key_hash == hash_key(issued.secret)
    assert stored.prefix == issued.secret[:11]
    assert issued.secret not in (stored.key_hash, stored.prefix, stored.name)


async def test_ensure_account_is_idempotent_and_checks_plans(sessions) -> None:
    async with sessions() as session:
        first = await ensure_account(session, "acme")
        again = await ensure_account(session, "acme")
        assert first.id == again.id and first.plan == "free"
        with pytest.raises(AccountError, match="Unknown plan"):
            await ensure_account(session, "acme", "platinum")


async def test_two_keys_never_share_a_hash(sessions) -> None:
    async with sessions() as session:
        account = await ensure_account(session, "acme")
        keys = [await issue_key(session, account) for _ in range(20)]
        await session.commit()
        count = await session.scalar(select(func.count(func.distinct(ApiKey.key_hash))))
    assert count == 20 and len({k.secret for k in keys}) == 20


async def _issued_key(sessions):  # noqa: ANN001, ANN202 - test helper
    async with sessions() as session:
        issued = await issue_key(session, await ensure_account(session, "acme"))
        await session.commit()
    return issued


async def test_ledger_opens_and_closes_one_row(sessions) -> None:
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)
    await ledger.open(request_id="r1", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint="chat", stream=True, created_at=datetime.now(UTC))
    await ledger.close("r1", Outcome(RequestStatus.SUCCEEDED, 200, queue_ms=3, ttft_ms=40, duration_ms=90,
                                     prompt_tokens=12, completion_tokens=7))
    # A second close (a late duplicate) changes nothing: the row is already final.
    await ledger.close("r1", Outcome(RequestStatus.FAILED, 500))
    async with sessions() as session:
        rows = (await session.scalars(select(RequestRecord))).all()
    assert len(rows) == 1
    row = rows[0]
    assert (row.status, row.http_status, row.prompt_tokens, row.completion_tokens) == ("succeeded", 200, 12, 7)
    assert (row.queue_ms, row.ttft_ms, row.duration_ms) == (3, 40, 90)


async def test_ledger_commits_concurrent_writes_together_and_exactly(sessions) -> None:
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)
    charge = Charge(plan="pro", price_micros=2000, quota_day="2026-12-02")

    async def one(i: int) -> None:
        await ledger.open(request_id=f"r{i}", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                          endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=charge)
        # Every third fails before its first token (not billable); each row gets a late duplicate close.
        failed = i % 3 == 0
        outcome = Outcome(RequestStatus.FAILED if failed else RequestStatus.SUCCEEDED, 500 if failed else 200,
                          completion_tokens=0 if failed else i, billable=not failed)
        await asyncio.gather(ledger.close(f"r{i}", outcome), ledger.close(f"r{i}", Outcome(RequestStatus.CANCELLED, 499)))

    await asyncio.gather(*(one(i) for i in range(60)))
    async with sessions() as session:
        rows = {r.id: r for r in await session.scalars(select(RequestRecord))}
        metered = set(await session.scalars(select(UsageOutbox.request_id)))
    assert len(rows) == 60
    for i in range(60):
        row = rows[f"r{i}"]
        if i % 3 == 0:
            assert (row.status, row.http_status, row.billable) == ("failed", 500, False)
        else:
            assert (row.status, row.completion_tokens, row.billable) == ("succeeded", i, True)
    # One meter event per billable request of a priced plan, none for the failed ones.
    assert metered == {f"r{i}" for i in range(60) if i % 3}


async def test_a_reused_idempotency_key_fails_only_its_own_write(sessions) -> None:
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)

    async def open_(request_id: str, key: str | None) -> None:
        await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                          endpoint="chat", stream=False, created_at=datetime.now(UTC), idempotency_key=key)

    # Opened together, so they share one transaction: the duplicate must not take the others down.
    results = await asyncio.gather(open_("a", "order-1"), open_("b", "order-1"), open_("c", None), open_("d", "order-2"),
                                   return_exceptions=True)
    assert results[0] is None and isinstance(results[1], DuplicateIdempotencyKey)
    assert results[2:] == [None, None]
    async with sessions() as session:
        ids = set(await session.scalars(select(RequestRecord.id)))
    assert ids == {"a", "c", "d"}


@pytest.fixture
def private_postgres(tmp_path) -> Iterator[PrivatePostgres]:  # noqa: ANN001
    """A PostgreSQL cluster of the test's own, migrated: it can be stopped and started (bench/postgres.py)."""
    reason = postgres_unavailable()
    if reason:
        unavailable(reason)
    services = Services()
    pg = PrivatePostgres(services, tmp_path).start()
    try:
        migrate(pg.url)
        yield pg
    finally:
        services.stop_all()
        pg.stop()


def _psql(pg: PrivatePostgres, query: str, **params: object) -> list[tuple]:
    with psycopg.connect(f"host={pg.address} port={pg.port} user=postgres dbname=flatfare", autocommit=True,
                         connect_timeout=5) as conn:
        return conn.execute(query, params).fetchall()


async def _until(predicate, what: str, timeout_s: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.mark.postgres
async def test_a_database_stopped_in_the_middle_of_a_batch_leaves_no_write_waiting(private_postgres) -> None:
    """PostgreSQL stops (`pg_ctl stop -m fast`) in the middle of a batch whose first error did not
    say the database is away (a reused Idempotency-Key: the batch is retried one write at a time),
    while the retry is inside a write. The opens after it must fail at once (their requests are
    refused) and the close wait for the database and land once it is back; before, the writer died
    when the one-by-one retry met the reset connection, and its waiters hung for ever."""
    pg = private_postgres
    engine = create_engine(pg.url, pool_size=2)
    sessions = session_factory(engine)
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)

    def start_open(request_id: str, key: str | None = None) -> asyncio.Future[None]:
        return ledger.start_open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id,
                                 model="m", endpoint="chat", stream=False, created_at=datetime.now(UTC),
                                 idempotency_key=key)

    await ledger.opened(start_open("closing"))
    # Another client holds the row, so the retry's close waits inside its transaction: the stop comes mid-write.
    blocker = psycopg.connect(f"host={pg.address} port={pg.port} user=postgres dbname=flatfare")
    blocker.execute("SELECT id FROM requests WHERE id = 'closing' FOR UPDATE")
    try:
        first, reused = start_open("first", "order-1"), start_open("reused", "order-1")
        closing = ledger.start_close("closing", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=3))
        after = start_open("after")
        await _until(lambda: _psql(pg, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
                     == [(1,)], "the batch's retry never reached the locked row")
        await ledger.opened(first, "order-1")
        with pytest.raises(DuplicateIdempotencyKey):
            await ledger.opened(reused, "order-1")
        pg.pause()
        async with asyncio.timeout(30):
            with pytest.raises((SQLAlchemyError, OSError)):
                await ledger.opened(after)
        await asyncio.sleep(3 * RETRY_S)  # the close is tried again while the database is down ...
        assert not closing.done()  # ... and keeps waiting: it neither failed nor was dropped
    finally:
        blocker.close()
    pg.resume()
    async with asyncio.timeout(30):
        await closing
    rows = _psql(pg, "SELECT id, status, completion_tokens FROM requests ORDER BY id")
    assert rows == [("closing", "succeeded", 3), ("first", "queued", 0)]
    await engine.dispose()


@pytest.mark.postgres
async def test_a_close_waits_while_the_database_is_shutting_down(private_postgres) -> None:
    """A close that meets "the database system is shutting down" (SQLSTATE 57P03: PostgreSQL in a
    smart shutdown, waiting for its last clients, refuses new connections) waits and lands once the
    database is back; it used to fail for good, leaving the row open and its unit held."""
    pg = private_postgres
    engine = create_engine(pg.url, pool_size=2)
    sessions = session_factory(engine)
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)
    await ledger.open(request_id="r", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
                      endpoint="chat", stream=False, created_at=datetime.now(UTC))
    await engine.dispose()  # the close below opens a new connection
    blocker = psycopg.connect(f"host={pg.address} port={pg.port} user=postgres dbname=flatfare")
    try:
        os.kill(pg.service.process.pid, signal.SIGTERM)  # a smart shutdown: it waits for the blocker

        def shutting_down() -> bool:
            try:
                _psql(pg, "SELECT 1")
            except psycopg.OperationalError as exc:
                return "shutting down" in str(exc)
            return False

        await _until(shutting_down, "PostgreSQL never began its shutdown")
        closing = ledger.start_close("r", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=3))
        await _until(lambda: ledger.unreachable_until > 0 or closing.done(), "the close never met the shutdown")
        assert not closing.done()  # it waits for the database rather than failing
    finally:
        blocker.close()
    pg.service.process.wait(timeout=60)  # the last client gone, the shutdown completes
    pg.services.stop(pg.service)
    pg.resume()
    async with asyncio.timeout(30):
        await closing
    assert _psql(pg, "SELECT status, completion_tokens FROM requests WHERE id = 'r'") == [("succeeded", 3)]
    await engine.dispose()


def _schema(database_url: str) -> tuple[dict[str, set[str]], str | None, int]:
    """Each table's columns and indexes (``ix:`` and the index's name), the migration revision, and the
    seeded plans (-1 without the table)."""
    from sqlalchemy import create_engine as create_sync_engine
    from sqlalchemy import inspect, text

    from tests.conftest import sync_url

    engine = create_sync_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            inspector = inspect(conn)
            tables = {t: {c["name"] for c in inspector.get_columns(t)}
                      # PostgreSQL also lists the index behind each unique constraint: not one of the models'.
                      | {f"ix:{i['name']}" for i in inspector.get_indexes(t) if not i.get("duplicates_constraint")}
                      for t in inspector.get_table_names()}
            revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar() \
                if "alembic_version" in tables else None
            plans = conn.execute(text("SELECT count(*) FROM plans")).scalar() if "plans" in tables else -1
    finally:
        engine.dispose()
    tables.pop("alembic_version", None)
    return tables, revision, plans


def _default_model_options(database_url: str) -> object:
    """The catalog's seeded entries and their engine options (a migration may change only those: 0006
    changes the default model's, 0009 adds gemma3-270m)."""
    from sqlalchemy import create_engine as create_sync_engine
    from sqlalchemy import text

    from tests.conftest import sync_url

    engine = create_sync_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            try:
                rows = conn.execute(text("SELECT name, engine_options FROM models")).all()
            except Exception:  # noqa: BLE001 - no models table at this revision
                return None
    finally:
        engine.dispose()
    return {name: json.loads(raw) if isinstance(raw, str) else raw for name, raw in rows}


def _plan_prices(database_url: str) -> dict[str, tuple[int, int]] | None:
    """The seeded plans' per-request and monthly prices (0008 changes the monthly, 0010 the per-request)."""
    from sqlalchemy import create_engine as create_sync_engine
    from sqlalchemy import text

    from tests.conftest import sync_url

    engine = create_sync_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            try:
                rows = conn.execute(text("SELECT name, price_per_request_micros, monthly_price_cents FROM plans")).all()
            except Exception:  # noqa: BLE001 - no plans table at this revision
                return None
    finally:
        engine.dispose()
    return {name: (per_request, monthly) for name, per_request, monthly in rows}


def _seeded(database_url: str) -> tuple[object, object]:
    """What migrations seed and may change without touching a table's shape."""
    return _default_model_options(database_url), _plan_prices(database_url)


def test_downgrade_and_upgrade_again(database_url: str) -> None:
    """Every migration's downgrade undoes it, one step at a time, down to an empty database, and its
    upgrade brings back exactly what the downgrade took; at head the tables are the models', seeded."""
    from alembic.script import ScriptDirectory

    from flatfare.storage.models import Base

    config = alembic_config(database_url)
    revisions = [r.revision for r in ScriptDirectory.from_config(config).walk_revisions()]  # newest first
    head, _, plans = _schema(database_url)
    assert _schema(database_url)[1] == revisions[0] and plans == 5
    # The migrations build the models' tables: their columns and their indexes.
    assert {t: set(Base.metadata.tables[t].columns.keys()) | {f"ix:{i.name}" for i in Base.metadata.tables[t].indexes}
            for t in Base.metadata.tables} == head
    at_revision = {}
    for revision, older in zip(revisions, [*revisions[1:], None]):
        at_revision[revision] = (_schema(database_url)[0], _seeded(database_url))
        command.downgrade(config, older or "base")
        tables, at, _ = _schema(database_url)
        state = (tables, _seeded(database_url))
        assert at == older and state != at_revision[revision], f"the downgrade of {revision} changed nothing"
    assert _schema(database_url) == ({}, None, -1)
    for revision in reversed(revisions):
        migrate(database_url, revision)
        tables, at, _ = _schema(database_url)
        assert at == revision and (tables, _seeded(database_url)) == at_revision[revision]
    assert _schema(database_url) == (head, revisions[0], 5)


def test_migrations_match_the_models(database_url: str) -> None:
    """What `alembic revision --autogenerate` would find: nothing."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine as create_sync_engine

    from flatfare.storage.models import Base
    from tests.conftest import sync_url

    engine = create_sync_engine(sync_url(database_url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


async def test_ledger_on_sqlite_waits_in_its_thread_while_another_connection_writes(tmp_path) -> None:
    """The SQLite ledger commits on the event loop only when the write lock is free; while another
    connection holds it, the batch waits in the writer thread, and the loop keeps serving."""
    url = f"sqlite:///{tmp_path / 'busy.db'}"
    migrate(url)
    engine = create_engine(url)
    sessions = session_factory(engine)
    issued = await _issued_key(sessions)
    ledger = Ledger(sessions)
    created = datetime.now(UTC).replace(microsecond=123456)
    blocker = sqlite3.connect(tmp_path / "busy.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    try:
        opening = asyncio.ensure_future(ledger.open(
            request_id="r-busy", account_id=issued.account_id, api_key_id=issued.key_id, model="m",
            endpoint="chat", stream=False, created_at=created))
        await asyncio.sleep(0.3)
        assert not opening.done()  # waiting for the lock, off the loop (this sleep ran)
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    await opening
    await ledger.close("r-busy", Outcome(RequestStatus.SUCCEEDED, 200, prompt_tokens=1, completion_tokens=2))
    async with sessions() as session:
        row = await session.get(RequestRecord, "r-busy")
    assert (row.status, row.completion_tokens) == ("succeeded", 2)
    assert row.created_at.replace(tzinfo=UTC) == created  # stored as SQLAlchemy's dialect stores it
    ledger.dispose()
    await engine.dispose()
