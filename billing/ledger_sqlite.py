"""The ledger's transactions on SQLite, written through ``sqlite3`` in one thread of their own.

aiosqlite hops to its thread and back for every statement, fetch and commit (~17 hops, ~1 ms of CPU,
for one ledger transaction here), and SQLAlchemy's execution machinery costs about as much again
per statement. The ledger's writer therefore runs each group-committed batch on a plain ``sqlite3``
connection with the ledger's statements prepared once from the tables' columns: on the event loop itself
when the write lock is free (a batch takes 0.1 to a few ms, and WAL commits with synchronous=NORMAL
do not sync), in a thread of its own when another connection holds the lock, and checkpoints there
too. Values are stored exactly as SQLAlchemy's SQLite dialect stores them (datetimes as
``YYYY-MM-DD HH:MM:SS.ffffff`` text, booleans as 0/1), so every reader sees the same rows; driver
errors are raised as SQLAlchemy's, so callers handle one kind. Other databases keep SQLAlchemy.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from flatfare.billing.ledger_rows import METER_COLUMNS, QUEUED_COLUMNS
from flatfare.billing.rollup import UPSERT_ACCOUNT, UPSERT_PLATFORM, Rollup
from flatfare.storage.db import sqlite_pragmas
from flatfare.storage.models import RequestRecord, RequestStatus, UsageOutbox, as_utc

log = logging.getLogger("flatfare.billing")

_REQUESTS = RequestRecord.__table__
_OUTBOX = UsageOutbox.__table__
# The SQLite dialect's DATETIME storage format.
_DATETIME = "%Y-%m-%d %H:%M:%S.%f"

_OPEN_COLUMNS = ("id", "account_id", "api_key_id", "model", "endpoint", "stream", "status", "created_at",
                 "prompt_tokens", "completion_tokens", "billable", "price_micros", "plan", "quota_day",
                 "idempotency_key", "body_sha256")
_CLOSE_COLUMNS = ("status", "http_status", "finished_at", "queue_ms", "ttft_ms", "duration_ms", "prompt_tokens",
                  "completion_tokens", "error_code", "billable")
for _table, _names in ((_REQUESTS, _OPEN_COLUMNS + _CLOSE_COLUMNS + QUEUED_COLUMNS), (_OUTBOX, METER_COLUMNS)):
    _missing = [name for name in _names if name not in _table.c]
    assert not _missing, f"{_table.name} has no columns {_missing}: update billing/ledger_sqlite.py"

_OPEN = f"INSERT INTO {_REQUESTS.name} ({', '.join(_OPEN_COLUMNS)}) VALUES ({', '.join('?' * len(_OPEN_COLUMNS))})"
_CLOSE = (f"UPDATE {_REQUESTS.name} SET {', '.join(f'{c} = ?' for c in _CLOSE_COLUMNS)} "
          f"WHERE id = ? AND status = '{RequestStatus.QUEUED.value}'")
_QUEUED = (f"SELECT {', '.join(QUEUED_COLUMNS)} FROM {_REQUESTS.name} "
           f"WHERE status = '{RequestStatus.QUEUED.value}' AND id IN ({{}})")
_METER = f"INSERT INTO {_OUTBOX.name} ({', '.join(METER_COLUMNS)}) VALUES ({', '.join('?' * len(METER_COLUMNS))})"


def _value(value: Any) -> Any:
    if isinstance(value, datetime):
        return as_utc(value).strftime(_DATETIME)
    if isinstance(value, bool):
        return int(value)
    return value


def _rows(dicts: list[dict[str, Any]], columns: tuple[str, ...]) -> list[tuple[Any, ...]]:
    return [tuple(map(_value, map(d.__getitem__, columns))) for d in dicts]


class _Statements:
    """The ledger's statements on one sqlite3 cursor, inside the caller's transaction."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    def insert_opens(self, rows: list[dict[str, Any]]) -> None:
        self._cursor.executemany(_OPEN, _rows(rows, _OPEN_COLUMNS))

    def queued(self, ids: list[str]) -> list[tuple[Any, ...]]:
        return self._cursor.execute(_QUEUED.format(", ".join("?" * len(ids))), ids).fetchall()

    def close_rows(self, updates: list[dict[str, Any]]) -> None:
        self._cursor.executemany(_CLOSE, [(*map(_value, map(u.__getitem__, _CLOSE_COLUMNS)), u["id"])
                                          for u in updates])

    def insert_meters(self, meters: list[dict[str, Any]]) -> None:
        self._cursor.executemany(_METER, _rows(meters, METER_COLUMNS))

    def add_usage(self, rollup: Rollup) -> None:
        if rollup:
            self._cursor.executemany(UPSERT_ACCOUNT, rollup.account_rows())
            self._cursor.executemany(UPSERT_PLATFORM, rollup.platform_rows())


class Busy(Exception):
    """Another connection holds the database's write lock: retry where waiting is allowed."""


# Commits between the WAL checkpoints the writer runs in its thread (the event loop's connection
# never checkpoints: a checkpoint copies pages and syncs, which must not stall the loop).
CHECKPOINT_EVERY = 500


class SqliteWriter:
    """The ledger's sqlite3 connections: one for the event loop, which never waits for a lock, and
    one for the writer thread, which waits up to 30 s (another process writing, a checkpoint). The
    ledger runs one transaction at a time, so the two are never used at once."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._connections: dict[bool, sqlite3.Connection] = {}
        self._commits = 0

    @classmethod
    def for_engine(cls, engine: AsyncEngine) -> SqliteWriter | None:
        """A writer on the engine's database if it is a SQLite file; None for any other database."""
        url = engine.url
        if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
            return None
        return cls(url.database)

    def transaction(self, work: Callable[[_Statements], None], *, inline: bool = False) -> None:
        """Run ``work`` in one transaction: committed if it returns, rolled back if it raises.

        ``inline`` (on the event loop): raises :class:`Busy` at once instead of waiting for a lock
        another connection holds; the caller retries in the writer thread."""
        connection = self._connect(inline)
        cursor = connection.cursor()
        statement = "BEGIN IMMEDIATE"
        try:
            cursor.execute(statement)
            statement = "ledger batch"
            work(_Statements(cursor))
            statement = "COMMIT"
            cursor.execute(statement)
        except sqlite3.Error as exc:
            if connection.in_transaction:
                connection.rollback()
            if inline and getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise Busy(str(exc)) from exc
            raise DBAPIError.instance(statement, None, exc, sqlite3.Error) from exc
        finally:
            cursor.close()
        self._commits += 1

    def checkpoint_due(self) -> bool:
        return self._commits >= CHECKPOINT_EVERY

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (in the writer thread)."""
        self._commits = 0
        try:
            self._connect(False).execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:  # the next one catches up; the batch it follows is committed
            log.warning("ledger WAL checkpoint failed: %s", exc)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    def _connect(self, inline: bool) -> sqlite3.Connection:
        connection = self._connections.get(inline)
        if connection is None:
            # Autocommit mode: transactions are the explicit BEGIN/COMMIT above.
            connection = sqlite3.connect(self._path, timeout=0 if inline else 30, isolation_level=None,
                                         check_same_thread=False)
            sqlite_pragmas(connection, None)
            if inline:
                connection.execute("PRAGMA busy_timeout=0")
                connection.execute("PRAGMA wal_autocheckpoint=0")
            self._connections[inline] = connection
        return connection
