"""The batch lines' results: read from ``contract.BATCH_REPLIES`` through its consumer group and
written to SQL with each line's ledger row (billing's own write path,
:func:`flatfare.billing.ledger_rows.record_batch_lines`), in one transaction, once.

A reply is acknowledged only after its transaction committed, so a dispatcher that dies in between
leaves it pending; the next one reads the pending replies first. A reply for a line that is no
longer queued (recorded already) is skipped: every line is recorded, and billed, at most once.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.billing.ledger_rows import FinishedLine, record_batch_lines
from flatfare.contract import Reply, ReplyKind
from flatfare.gateway.batches.protocol import ENDPOINTS
from flatfare.storage.models import Batch, BatchLine, BatchLineStatus

log = logging.getLogger("flatfare.batches")

# One consumer name for every process: whichever holds the lease reads the previous leader's pending replies.
CONSUMER = "leader"
READ_COUNT = 500


@dataclass(frozen=True, slots=True)
class LineResult:
    batch_id: str
    line: int
    reply: Reply

    @property
    def request_id(self) -> str:
        return contract.batch_request_id(self.batch_id, self.line)


def parse_request_id(request_id: str) -> tuple[str, int] | None:
    batch_id, _, line = request_id.rpartition("-")
    return (batch_id, int(line)) if batch_id.startswith("batch_") and line.isdigit() else None


class ResultCollector:
    def __init__(self, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession],
                 on_line: Callable[[str, bool], None] | None = None) -> None:
        self.redis = redis
        self._sessions = sessions
        # Told of each line recorded (its model, whether the engine answered it), once committed.
        self._on_line = on_line

    async def setup(self) -> None:
        try:
            await self.redis.xgroup_create(contract.BATCH_REPLIES, contract.BATCH_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def collect(self) -> int:
        """Record a read of the replies waiting (the pending ones first); returns how many it read."""
        entries = await self._read("0") or await self._read(">")
        if not entries:
            return 0
        results: list[LineResult] = []
        for _entry_id, fields in entries:
            if not fields or fields.get(b"k") == ReplyKind.HELD.value.encode():
                continue
            named = parse_request_id(fields.get(b"i", b"").decode())
            reply = Reply.from_entry(fields)
            if named is not None and reply.kind.terminal:
                results.append(LineResult(named[0], named[1], reply))
        if results:
            await self._record(results)
        ids = [entry_id for entry_id, _ in entries]
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(contract.BATCH_REPLIES, contract.BATCH_GROUP, *ids)
            pipe.xdel(contract.BATCH_REPLIES, *ids)
            await pipe.execute()
        return len(entries)

    async def drain(self) -> None:
        """Record every reply written so far."""
        while await self.collect():
            pass

    async def _read(self, start: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        try:
            result = await self.redis.xreadgroup(contract.BATCH_GROUP, CONSUMER, {contract.BATCH_REPLIES: start},
                                                 count=READ_COUNT)
        except ResponseError as exc:  # the stream expired with its group (no batch line for a while)
            if "NOGROUP" not in str(exc):
                raise
            await self.setup()
            return []
        return [entry for _stream, entries in result or [] for entry in entries]

    async def _record(self, results: list[LineResult]) -> None:
        by_batch: dict[str, dict[int, LineResult]] = defaultdict(dict)
        for result in results:
            by_batch[result.batch_id][result.line] = result
        async with self._sessions() as session, session.begin():
            finished: list[FinishedLine] = []
            for batch_id, lines in by_batch.items():
                batch = await session.get(Batch, batch_id)
                if batch is None:
                    continue
                queued = (await session.scalars(select(BatchLine).where(
                    BatchLine.batch_id == batch_id, BatchLine.line.in_(list(lines)),
                    BatchLine.status == BatchLineStatus.QUEUED.value))).all()
                for row in queued:
                    finished.append(_finished(batch, row, lines[row.line]))
                if queued:
                    done = sum(line.answered for line in finished[-len(queued):])
                    await session.execute(update(Batch).where(Batch.id == batch_id).values(
                        completed=Batch.completed + done, failed=Batch.failed + len(queued) - done))
            if finished:
                # A line that failed in the engine is free; one that answered is billed once, here: its
                # ledger row's key is the batch id and line.
                await record_batch_lines(session, finished)
        if self._on_line is not None:
            for line in finished:
                self._on_line(line.model, line.answered)


def _finished(batch: Batch, row: BatchLine, result: LineResult) -> FinishedLine:
    """The line's state and result from its reply; what its ledger row records."""
    reply = result.reply
    answered = reply.kind is ReplyKind.RESPONSE and reply.status < 400
    row.status = (BatchLineStatus.DONE if answered else BatchLineStatus.FAILED).value
    row.status_code = reply.status if reply.kind is not ReplyKind.END else 500
    row.result = reply.data or '{"error": {"message": "No answer came back.", "type": "server_error"}}'
    return FinishedLine(result.request_id, batch.account_id, batch.api_key_id, row.model,
                        ENDPOINTS[batch.endpoint].value, answered, row.status_code, reply.usage)
