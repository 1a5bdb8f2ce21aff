"""The ledger's SQLite writer on a real SQLite file: batches written through plain ``sqlite3`` read back
through SQLAlchemy exactly as if SQLAlchemy had written them, one row per request id, a reused
Idempotency-Key failing alone (on the event loop and in the writer thread), the loop's connection
never waiting for another writer's lock, and the WAL checkpointed by the writer.

tests/storage/test_storage.py covers the ledger on both databases and the thread waiting while
another connection writes; these cover what is SQLite's own."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing import ledger_sqlite
from flatfare.billing.ledger import Charge, DuplicateIdempotencyKey, Ledger, Outcome
from flatfare.billing.ledger_sqlite import Busy, SqliteWriter
from flatfare.storage.accounts import IssuedKey
from flatfare.storage.db import create_engine, migrate, session_factory
from flatfare.storage.models import RequestRecord, RequestStatus, UsageOutbox
from tests.billing.conftest import account_with_key

CHARGE = Charge(plan="pro", price_micros=2000, quota_day="2026-12-03")
# How SQLAlchemy's SQLite dialect stores a DATETIME: the writer must store the same text, or string
# comparisons in SQL (the outbox's "next_attempt_at <= now") go wrong.
DIALECT_DATETIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}$")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    database = tmp_path / "ledger.db"
    migrate(f"sqlite:///{database}")
    return database


@pytest.fixture
async def sessions(path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(f"sqlite:///{path}")
    yield session_factory(engine)
    await engine.dispose()


@pytest.fixture
async def ledger(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[Ledger]:
    writer = Ledger(sessions)
    assert writer._sqlite is not None  # the SQLite path, not SQLAlchemy's
    yield writer
    writer.dispose()


@pytest.fixture
async def key(sessions: async_sessionmaker[AsyncSession]) -> IssuedKey:
    return await account_with_key(sessions, "acme")


def _open(ledger: Ledger, key: IssuedKey, request_id: str, *, idempotency_key: str | None = None,
          charge: Charge | None = CHARGE, created_at: datetime | None = None) -> asyncio.Future[None]:
    return ledger.start_open(request_id=request_id, account_id=key.account_id, api_key_id=key.key_id, model="m",
                             endpoint="chat", stream=True, created_at=created_at or datetime.now(UTC),
                             charge=charge, idempotency_key=idempotency_key, body_sha256="ab" * 32)


class _Blocker:
    """Another connection (another process, the CLI) holding the database's write lock."""

    def __init__(self, path: Path) -> None:
        self._connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._connection.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self._connection.execute("COMMIT")
        self._connection.close()


def test_a_writer_is_made_only_for_a_sqlite_file(path: Path) -> None:
    assert isinstance(SqliteWriter.for_engine(create_engine(f"sqlite:///{path}")), SqliteWriter)
    assert SqliteWriter.for_engine(create_engine("sqlite:///:memory:")) is None
    assert SqliteWriter.for_engine(create_engine("postgresql://nobody@127.0.0.1:9/none")) is None


async def test_batches_read_back_through_sqlalchemy_as_it_writes_them(sessions, ledger, key, path) -> None:
    created = datetime(2026, 12, 3, 10, 0, 0, 123456, tzinfo=UTC)
    # One batch of opens, then one of closes (a late duplicate close among them).
    await asyncio.gather(*(_open(ledger, key, f"r{i}", created_at=created) for i in range(3)),
                         _open(ledger, key, "free", charge=None, created_at=created))
    before_close = datetime.now(UTC)
    await asyncio.gather(
        ledger.close("r0", Outcome(RequestStatus.SUCCEEDED, 200, queue_ms=1, ttft_ms=2, duration_ms=3,
                                   prompt_tokens=4, completion_tokens=5)),
        ledger.close("r0", Outcome(RequestStatus.CANCELLED, 499)),
        ledger.close("r1", Outcome(RequestStatus.FAILED, 500, error_code="worker_error", billable=False)),
        ledger.close("r2", Outcome(RequestStatus.SUCCEEDED, 200)),
        ledger.close("free", Outcome(RequestStatus.SUCCEEDED, 200)))

    async with sessions() as session:
        rows = {r.id: r for r in await session.scalars(select(RequestRecord))}
        meters = {m.request_id: m for m in await session.scalars(select(UsageOutbox))}
        # The outbox sender's own query, a string comparison on SQLite, finds the rows due.
        due = set(await session.scalars(select(UsageOutbox.request_id)
                                        .where(UsageOutbox.next_attempt_at <= datetime.now(UTC))))
    r0 = rows["r0"]
    assert (r0.status, r0.http_status, r0.queue_ms, r0.ttft_ms, r0.duration_ms, r0.prompt_tokens,
            r0.completion_tokens) == ("succeeded", 200, 1, 2, 3, 4, 5)  # the first close won
    assert r0.created_at == created and r0.created_at.tzinfo is UTC
    assert before_close <= r0.finished_at <= datetime.now(UTC)
    assert (r0.stream, r0.billable, r0.price_micros, r0.plan, r0.quota_day) == (True, True, 2000, "pro", "2026-12-03")
    assert (rows["r1"].status, rows["r1"].billable, rows["r1"].error_code) == ("failed", False, "worker_error")
    assert (rows["free"].billable, rows["free"].price_micros) == (False, 0)
    # One meter event per billable, priced request: none for the failed one or the free one.
    assert set(meters) == due == {"r0", "r2"}
    assert (meters["r0"].status, meters["r0"].attempts, meters["r0"].day) == ("pending", 0, "2026-12-03")
    assert meters["r0"].next_attempt_at == meters["r0"].created_at

    raw = sqlite3.connect(path)
    stored = raw.execute("SELECT created_at, finished_at, billable, stream FROM requests WHERE id = 'r0'").fetchone()
    next_attempt = raw.execute("SELECT next_attempt_at FROM usage_outbox WHERE request_id = 'r0'").fetchone()[0]
    raw.close()
    assert stored[0] == "2026-12-03 10:00:00.123456"
    assert DIALECT_DATETIME.match(stored[1]) and DIALECT_DATETIME.match(next_attempt)
    assert stored[2:] == (1, 1)


async def test_one_row_per_request_id(sessions, ledger, key) -> None:
    await _open(ledger, key, "r1")
    with pytest.raises(IntegrityError):  # raised as SQLAlchemy's error, whatever the driver
        await ledger.opened(_open(ledger, key, "r1", charge=None))
    await ledger.close("r1", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=1))
    await ledger.close("r1", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=9))  # a late duplicate
    async with sessions() as session:
        rows = (await session.scalars(select(RequestRecord))).all()
        meters = (await session.scalars(select(UsageOutbox))).all()
    assert [(r.id, r.price_micros, r.completion_tokens) for r in rows] == [("r1", 2000, 1)]
    assert [m.request_id for m in meters] == ["r1"]


@pytest.mark.parametrize("lock", ["free", "held by another connection"])
async def test_a_reused_idempotency_key_fails_alone_in_a_mixed_batch(sessions, ledger, key, path, lock) -> None:
    """A batch of opens and closes in which one open reuses a key: that open fails, every other write
    of the batch commits, once. With the lock held the batch goes to the writer thread first."""
    await _open(ledger, key, "earlier", idempotency_key="order-1")
    await _open(ledger, key, "closing")
    blocker = _Blocker(path) if lock != "free" else None
    writes = asyncio.gather(
        ledger.close("closing", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=2)),
        ledger.opened(_open(ledger, key, "reused", idempotency_key="order-1"), "order-1"),
        ledger.opened(_open(ledger, key, "fresh", idempotency_key="order-2"), "order-2"),
        ledger.opened(_open(ledger, key, "plain")),
        return_exceptions=True)
    if blocker is not None:
        await asyncio.sleep(0.2)
        assert not writes.done()  # waiting in the thread for the lock, while the loop runs
        blocker.release()
    results = await asyncio.wait_for(writes, 30)
    assert results[0] is None and isinstance(results[1], DuplicateIdempotencyKey) and results[2:] == [None, None]
    async with sessions() as session:
        rows = {r.id: r for r in await session.scalars(select(RequestRecord))}
        meters = list(await session.scalars(select(UsageOutbox.request_id)))
    assert set(rows) == {"earlier", "closing", "fresh", "plain"}
    assert rows["closing"].status == "succeeded" and meters == ["closing"]
    assert (rows["earlier"].idempotency_key, rows["fresh"].idempotency_key) == ("order-1", "order-2")


def _insert_account(db) -> None:  # noqa: ANN001 - the writer's statements
    db._cursor.execute("INSERT INTO accounts (name, plan, status, unlimited) VALUES ('written', 'free', 'active', 0)")


def test_the_loop_connection_never_waits_for_anothers_lock(path: Path) -> None:
    writer = SqliteWriter(str(path))
    blocker = _Blocker(path)
    try:
        started = time.monotonic()
        with pytest.raises(Busy):
            writer.transaction(_insert_account, inline=True)
        assert time.monotonic() - started < 5  # at once, where the thread's connection waits 30 s

        # The writer thread's connection waits for the lock instead, and commits once it is free.
        finished = threading.Event()
        thread = threading.Thread(target=lambda: (writer.transaction(_insert_account), finished.set()))
        thread.start()
        assert not finished.wait(0.3)
        blocker.release()
        thread.join(30)
        assert finished.is_set()
    finally:
        writer.close()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT count(*) FROM accounts WHERE name = 'written'").fetchone() == (1,)
    raw.close()


def test_a_failed_batch_leaves_nothing_and_the_connection_usable(path: Path) -> None:
    writer = SqliteWriter(str(path))

    def half_then_fail(db) -> None:  # noqa: ANN001
        _insert_account(db)
        _insert_account(db)  # accounts.name is unique

    try:
        with pytest.raises(DBAPIError) as failed:
            writer.transaction(half_then_fail, inline=True)
        assert isinstance(failed.value, IntegrityError) and failed.value.statement == "ledger batch"
        writer.transaction(_insert_account, inline=True)  # no transaction left open on the connection
    finally:
        writer.close()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT count(*) FROM accounts WHERE name = 'written'").fetchone() == (1,)
    raw.close()


async def test_the_writer_checkpoints_the_wal(sessions, key, path, monkeypatch) -> None:
    """The loop's connection never checkpoints (wal_autocheckpoint=0); the writer thread does every
    CHECKPOINT_EVERY commits, so the WAL is reused instead of growing with every commit."""
    monkeypatch.setattr(ledger_sqlite, "CHECKPOINT_EVERY", 10)
    ledger = Ledger(sessions)
    try:
        for i in range(300):  # one commit each
            await ledger.open(request_id=f"r{i}", account_id=key.account_id, api_key_id=key.key_id, model="m",
                              endpoint="chat", stream=False, created_at=datetime.now(UTC))
    finally:
        ledger.dispose()
    async with sessions() as session:
        assert await session.scalar(text("SELECT count(*) FROM requests")) == 300
    wal = path.with_name(path.name + "-wal")
    # Each commit appends a few 4 KiB pages: 300 of them without a checkpoint leave a WAL of ~7 MB here.
    assert wal.stat().st_size < 300 * 4096, wal.stat().st_size


def test_datetimes_are_stored_in_utc_in_the_dialects_format() -> None:
    moment = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert ledger_sqlite._value(moment) == "2026-01-02 03:04:05.000006"
    assert ledger_sqlite._value(moment.astimezone(timezone(timedelta(hours=2)))) == "2026-01-02 03:04:05.000006"
    assert ledger_sqlite._value(True) == 1 and ledger_sqlite._value("x") == "x"
