"""The request ledger: one row per accepted request, opened when it is queued, closed when it ends.

What each open and close writes (the row, the outbox row of a billable priced request, the usage
rollup's deltas, in one transaction) is :mod:`flatfare.billing.ledger_rows`'; this module is how live
requests' writes reach the database, and what is read back (idempotency keys, billable counts for a
quota rebuild).

Writes are group-committed: every open and close that arrives while a transaction is in flight
waits for the next one, which writes them all (one INSERT for the opens, one SELECT, one UPDATE and
one INSERT for the closes, two upserts for the rollup). Each caller still returns only once its own
row is committed. The statements are SQLAlchemy Core on the tables, prepared once: the ORM's unit of work, and one
transaction per row, cost ~10 ms of CPU a request on SQLite here (bench/results/profile.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from flatfare.billing.ledger_rows import (BATCH_ENDPOINT_PREFIX, QUEUED_COLUMNS, Charge, CoreStatements, Outcome,
                                          Write, made_free, opening_row, write_batch)
from flatfare.billing.ledger_sqlite import Busy, SqliteWriter
from flatfare.billing.rollup import Rollup
from flatfare.storage.db import DATABASE_DOWN
from flatfare.storage.models import RequestRecord, RequestStatus

__all__ = ["BATCH_ENDPOINT_PREFIX", "Charge", "DuplicateIdempotencyKey", "Ledger", "Outcome", "daily_usage"]


class DuplicateIdempotencyKey(Exception):
    """The account already sent a request with this Idempotency-Key."""


log = logging.getLogger("flatfare.billing")

_REQUESTS = RequestRecord.__table__
# Most writes a transaction takes; more wait for the next one.
MAX_BATCH = 256
# Seconds between tries of closes waiting for an unreachable database.
RETRY_S = 0.5


class Abandoned(dict[str, bool]):
    """What :meth:`Ledger.abandon` found: whether each existing row is billable now, and ``closed``, how many
    rows this call closed (the rest were closed already)."""

    closed: int = 0


class Ledger:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions
        self._engine: AsyncEngine = sessions.kw["bind"]
        self._sqlite = SqliteWriter.for_engine(self._engine)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger") if self._sqlite else None
        self._pending: list[Write] = []
        self._writer: asyncio.Task[None] | None = None
        # Until when (monotonic) the database counts as unreachable after a failed write: requests
        # are refused before they are queued meanwhile, rather than queued and withdrawn.
        self.unreachable_until = 0.0

    async def open(self, *, request_id: str, account_id: int, api_key_id: int, model: str, endpoint: str,
                   stream: bool, created_at: datetime, charge: Charge | None = None,
                   idempotency_key: str | None = None, body_sha256: str | None = None) -> None:
        """Write the request's row; returns once it is committed."""
        await self.opened(self.start_open(
            request_id=request_id, account_id=account_id, api_key_id=api_key_id, model=model, endpoint=endpoint,
            stream=stream, created_at=created_at, charge=charge, idempotency_key=idempotency_key,
            body_sha256=body_sha256), idempotency_key)

    def start_open(self, *, request_id: str, account_id: int, api_key_id: int, model: str, endpoint: str,
                   stream: bool, created_at: datetime, charge: Charge | None = None,
                   idempotency_key: str | None = None, body_sha256: str | None = None) -> asyncio.Future[None]:
        """Queue the request's row for the next group commit without waiting: the caller queues the
        job meanwhile and awaits :meth:`opened` before it answers (so no answer leaves before its row
        is committed)."""
        row = opening_row(request_id=request_id, account_id=account_id, api_key_id=api_key_id, model=model,
                          endpoint=endpoint, stream=stream, created_at=created_at, charge=charge,
                          idempotency_key=idempotency_key, body_sha256=body_sha256)
        done = self._queue(request_id, opening=row)
        done.add_done_callback(_retrieve)  # a request that ended early may never await it
        return done

    @staticmethod
    async def opened(done: asyncio.Future[None], idempotency_key: str | None = None) -> None:
        """Wait for a row queued by :meth:`start_open` to be committed."""
        try:
            await asyncio.shield(done)
        except IntegrityError as exc:
            if idempotency_key is not None:
                raise DuplicateIdempotencyKey(idempotency_key) from exc
            raise

    async def close(self, request_id: str, outcome: Outcome) -> None:
        """Make the row final; a late duplicate (the row is no longer queued) changes nothing."""
        await asyncio.shield(self.start_close(request_id, outcome))

    def start_close(self, request_id: str, outcome: Outcome) -> asyncio.Future[None]:
        """Queue the row's close; the future is done once it is committed. While the database is
        unreachable, closes wait in memory and are tried again every :data:`RETRY_S` (an open, by
        contrast, fails at once: its request is refused)."""
        done = self._queue(request_id, outcome=outcome)
        done.add_done_callback(_retrieve)
        return done

    def _queue(self, request_id: str, *, opening: dict[str, object] | None = None,
               outcome: Outcome | None = None) -> asyncio.Future[None]:
        done = asyncio.get_running_loop().create_future()
        self._pending.append(Write(request_id, opening, outcome, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        # Callers await it shielded: one that goes away still leaves its write to the batch it joined.
        return done

    async def _drain(self) -> None:
        """Commit what is pending, one transaction at a time, until nothing is; then end."""
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:  # whatever escapes the handling below, every waiter of the batch hears of it
                try:
                    await self._commit(batch)
                except DATABASE_DOWN as exc:
                    if _unreachable(exc):
                        await self._wait_for_database(batch, exc)
                    elif len(batch) == 1:
                        _settle(batch, exc)
                    else:  # one bad write (a reused Idempotency-Key) must not fail the others
                        await self._one_by_one(batch)
                else:
                    _settle(batch, None)
            except BaseException as exc:  # noqa: BLE001 - the waiters must hear of it, whatever it is
                _settle(batch, exc)
                if isinstance(exc, asyncio.CancelledError):
                    _settle(self._pending, exc)
                    self._pending = []
                    raise

    async def _wait_for_database(self, batch: list[Write], exc: BaseException) -> None:
        """Opens fail now (their requests are refused); closes wait for the database."""
        self.unreachable_until = time.monotonic() + RETRY_S
        closes = [write for write in batch if write.opening is None]
        _settle([write for write in batch if write.opening is not None], exc)
        if closes:
            log.warning("ledger unreachable (%s); %d closes wait", exc.__class__.__name__, len(closes))
            self._pending[:0] = closes
            await asyncio.sleep(RETRY_S)

    async def _one_by_one(self, batch: list[Write]) -> None:
        for index, write in enumerate(batch):
            try:
                await self._commit([write])
            except DATABASE_DOWN as exc:
                if _unreachable(exc):  # the database went away meanwhile (its first error did not say so)
                    await self._wait_for_database(batch[index:], exc)
                    return
                _settle([write], exc)
            else:
                _settle([write], None)

    async def _commit(self, batch: list[Write]) -> None:
        if self._sqlite is not None:  # SQLite: on the loop if the lock is free, else in the thread
            writer = self._sqlite
            try:
                writer.transaction(lambda db: write_batch(db, batch), inline=True)
            except Busy:
                await asyncio.get_running_loop().run_in_executor(self._thread, self._commit_in_thread, batch)
            if writer.checkpoint_due():
                await asyncio.get_running_loop().run_in_executor(self._thread, writer.checkpoint)
            return
        async with self._engine.begin() as conn:
            await conn.run_sync(lambda sync: write_batch(CoreStatements(sync), batch))

    def _commit_in_thread(self, batch: list[Write]) -> None:
        self._sqlite.transaction(lambda db: write_batch(db, batch))  # type: ignore[union-attr]

    def dispose(self) -> None:
        """Close the SQLite writer's connection and thread (nothing to do for other databases)."""
        if self._sqlite is not None:
            self._thread.submit(self._sqlite.close)  # type: ignore[union-attr]
            self._thread.shutdown(wait=False)  # type: ignore[union-attr]

    async def find_idempotent(self, account_id: int, idempotency_key: str) -> RequestRecord | None:
        async with self._sessions() as session:
            return await session.scalar(select(RequestRecord).where(
                RequestRecord.account_id == account_id, RequestRecord.idempotency_key == idempotency_key))

    async def release_idempotency_key(self, request_id: str) -> None:
        """Free an expired Idempotency-Key so the account may use it again."""
        async with self._sessions() as session:
            await session.execute(update(RequestRecord).where(RequestRecord.id == request_id)
                                  .values(idempotency_key=None))
            await session.commit()

    async def abandon(self, request_ids: list[str], error_code: str) -> Abandoned:
        """Close the rows still open among ``request_ids`` as failed and free (their gateway died
        before it could settle them); returns whether each existing row is billable now. An id
        without a row is absent from the answer."""
        now = datetime.now(UTC)
        async with self._engine.begin() as conn:
            closing = (_REQUESTS.update()
                       .where(_REQUESTS.c.id.in_(request_ids), _REQUESTS.c.status == RequestStatus.QUEUED.value)
                       .values(status=RequestStatus.FAILED.value, http_status=502, finished_at=now,
                               error_code=error_code, billable=False))
            # The billable ones first, returning what the rollup needs (an UPDATE takes the write
            # lock at once: nothing can close them between reading and writing), then the others.
            freed = await conn.execute(closing.where(_REQUESTS.c.billable.is_(True))
                                       .returning(*(_REQUESTS.c[name] for name in QUEUED_COLUMNS)))
            rollup = Rollup()
            freed_rows = freed.all()
            for row in freed_rows:
                made_free(rollup, tuple(row))
            rest = await conn.execute(closing)
            await conn.run_sync(lambda sync: CoreStatements(sync).add_usage(rollup))
            rows = await conn.execute(select(_REQUESTS.c.id, _REQUESTS.c.billable)
                                      .where(_REQUESTS.c.id.in_(request_ids)))
            found = Abandoned({request_id: bool(billable) for request_id, billable in rows})
            found.closed = len(freed_rows) + max(rest.rowcount or 0, 0)
            return found

    async def billable_counts(self, days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        """Billable requests per (account, quota day), but ``leave_out``: what the counters must say."""
        return await self._billable_per(RequestRecord.account_id, days, leave_out)

    async def billable_key_counts(self, days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        """Billable requests per (API key, quota day), but ``leave_out``: what the keys' counters must say."""
        return await self._billable_per(RequestRecord.api_key_id, days, leave_out)

    async def _billable_per(self, owner: Any, days: list[str], leave_out: tuple[str, ...]) -> dict[tuple[int, str], int]:
        async with self._sessions() as session:
            rows = await session.execute(
                select(owner, RequestRecord.quota_day, func.count())
                .where(RequestRecord.billable.is_(True), RequestRecord.quota_day.in_(days),
                       RequestRecord.id.not_in(leave_out), ~RequestRecord.endpoint.startswith(BATCH_ENDPOINT_PREFIX))
                .group_by(owner, RequestRecord.quota_day))
            return {(owner_id, day): count for owner_id, day, count in rows}


async def daily_usage(sessions: async_sessionmaker[AsyncSession], account_id: int,
                      days: list[str]) -> list[dict[str, object]]:
    """Billable requests per day and model over ``days``, oldest first."""
    async with sessions() as session:
        rows = await session.execute(
            select(RequestRecord.quota_day, RequestRecord.model, func.count())
            .where(RequestRecord.account_id == account_id, RequestRecord.billable.is_(True),
                   RequestRecord.quota_day.in_(days))
            .group_by(RequestRecord.quota_day, RequestRecord.model)
            .order_by(RequestRecord.quota_day, RequestRecord.model))
        return [{"day": day, "model": model, "requests": count} for day, model, count in rows]


def _unreachable(exc: BaseException) -> bool:
    """The database is away (down, restarting, locked), as opposed to refusing this write."""
    return (isinstance(exc, (OperationalError, InterfaceError, OSError))
            or bool(getattr(exc, "connection_invalidated", False))
            or _away(getattr(getattr(exc, "orig", None), "sqlstate", None)))


def _away(sqlstate: str | None) -> bool:
    """PostgreSQL's codes for a server that is not there for anyone: class 08 (connection exception)
    and 57P01-57P03 (admin shutdown, crash shutdown, cannot connect now: "the database system is
    shutting down"), which asyncpg raises as plain errors, not as connection failures."""
    return bool(sqlstate) and (sqlstate.startswith("08") or sqlstate in ("57P01", "57P02", "57P03"))


def _retrieve(done: asyncio.Future[None]) -> None:
    if not done.cancelled():
        done.exception()


def _settle(batch: list[Write], error: BaseException | None) -> None:
    for write in batch:
        if write.done is None or write.done.done():
            continue
        if error is None:
            write.done.set_result(None)
        else:
            write.done.set_exception(error)
