"""The Batch API's requests: create, read, list and cancel an account's batches (SQL only: the
dispatcher does the running)."""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.gateway.auth import Caller
from flatfare.gateway.batches.files import BatchFiles
from flatfare.gateway.batches.protocol import BatchCreate
from flatfare.gateway.errors import APIError
from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.models import Batch, BatchStatus

WINDOW = timedelta(hours=24)
# The batch's trace outlives its window by this much: a line still running at the deadline is in it.
TRACE_SLACK = timedelta(hours=1)
# A batch can be cancelled until it has finished running its lines.
CANCELLABLE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)


def _not_found(batch_id: str) -> APIError:
    # Another account's batch is as absent as one that never was.
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


class BatchService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], files: BatchFiles, redis: aioredis.Redis) -> None:
        self._sessions = sessions
        self._files = files
        self._redis = redis

    async def create(self, caller: Caller, request: BatchCreate, traceparent: str = "") -> Batch:
        """The batch, validating; ``traceparent`` (the creating request's span) is the parent of its lines'."""
        if not await self._files.input_exists(caller.account_id, request.input_file_id):
            raise APIError(400, f"No file '{request.input_file_id}' of purpose 'batch' in this account: upload "
                           "the requests with POST /v1/files and purpose=batch first.", param="input_file_id",
                           code="invalid_input_file")
        now = datetime.now(UTC)
        batch = Batch(id=f"batch_{uuid.uuid4().hex[:24]}", account_id=caller.account_id, api_key_id=caller.key_id,
                      endpoint=request.endpoint, input_file_id=request.input_file_id,
                      completion_window=request.completion_window, status=BatchStatus.VALIDATING.value,
                      metadata_=request.metadata, total=0, completed=0, failed=0, created_at=now,
                      expires_at=now + WINDOW)
        async with self._sessions() as session, session.begin():
            session.add(batch)
        if traceparent:  # kept while the batch may run; without it (Redis down) each line is a trace of its own
            with contextlib.suppress(*REDIS_DOWN):
                await self._redis.set(contract.batch_trace_key(batch.id), traceparent,
                                      ex=int((WINDOW + TRACE_SLACK).total_seconds()))
        return batch

    async def get(self, caller: Caller, batch_id: str) -> Batch:
        async with self._sessions() as session:
            batch = await session.get(Batch, batch_id)
        if batch is None or batch.account_id != caller.account_id:
            raise _not_found(batch_id)
        return batch

    async def list(self, caller: Caller, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The account's batches, newest first, after the batch ``after``; and whether more follow."""
        query = select(Batch).where(Batch.account_id == caller.account_id)
        if after is not None:
            cursor = await self.get(caller, after)
            query = query.where((Batch.created_at < cursor.created_at)
                                | ((Batch.created_at == cursor.created_at) & (Batch.id < cursor.id)))
        async with self._sessions() as session:
            rows = list((await session.scalars(
                query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1))).all())
        return rows[:limit], len(rows) > limit

    async def cancel(self, caller: Caller, batch_id: str) -> Batch:
        """Cancelling: the dispatcher stops feeding its lines, ends the running ones and writes what
        finished; then it is cancelled."""
        await self.get(caller, batch_id)
        async with self._sessions() as session, session.begin():
            await session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(CANCELLABLE))
                                  .values(status=BatchStatus.CANCELLING.value, cancelling_at=datetime.now(UTC)))
        batch = await self.get(caller, batch_id)
        if batch.status not in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
            raise APIError(409, f"Batch '{batch_id}' is {batch.status}: only a validating or in-progress batch "
                           "can be cancelled.", param="batch_id", code="batch_not_cancellable")
        return batch
