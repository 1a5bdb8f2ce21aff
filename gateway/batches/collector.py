"""The batch lines' results: read from ``contract.BATCH_REPLIES`` through its consumer group and
written to SQL with each line's ledger row, in one transaction, once.

A reply is acknowledged only after its transaction committed, so a dispatcher that dies in between
leaves it pending; the next one reads the pending replies first. A reply for a line that is no
longer queued (recorded already) is skipped: every line is recorded, and billed, at most once.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare import contract
from flatfare.billing.ledger import BATCH_ENDPOINT_PREFIX
from flatfare.billing.plans import effective_plan_name, quota_window
from flatfare.billing.usage import UPSERT_ACCOUNT, UPSERT_PLATFORM, Rollup
from flatfare.contract import Reply, ReplyKind
from flatfare.gateway.batches.lines import line_price
from flatfare.gateway.batches.protocol import ENDPOINTS
from flatfare.storage.models import (Account, Batch, BatchLine, BatchLineStatus, Meter, OutboxStatus, Plan,
                                     RequestRecord, RequestStatus, UsageOutbox)

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
    def __init__(self, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.redis = redis
        self._sessions = sessions

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
        now = datetime.now(UTC)
        by_batch: dict[str, dict[int, LineResult]] = defaultdict(dict)
        for result in results:
            by_batch[result.batch_id][result.line] = result
        async with self._sessions() as session, session.begin():
            rollup = Rollup()
            pricing = _Pricing(session, now)
            for batch_id, lines in by_batch.items():
                batch = await session.get(Batch, batch_id)
                if batch is None:
                    continue
                queued = (await session.scalars(select(BatchLine).where(
                    BatchLine.batch_id == batch_id, BatchLine.line.in_(list(lines)),
                    BatchLine.status == BatchLineStatus.QUEUED.value))).all()
                done = failed = 0
                for row in queued:
                    ok = await self._record_line(session, pricing, rollup, batch, row, lines[row.line], now)
                    done, failed = done + ok, failed + (not ok)
                if queued:
                    await session.execute(update(Batch).where(Batch.id == batch_id).values(
                        completed=Batch.completed + done, failed=Batch.failed + failed))
            if rollup:
                await session.execute(text(UPSERT_ACCOUNT), rollup.account_rows())
                await session.execute(text(UPSERT_PLATFORM), rollup.platform_rows())

    async def _record_line(self, session: AsyncSession, pricing: _Pricing, rollup: Rollup, batch: Batch,
                           row: BatchLine, result: LineResult, now: datetime) -> bool:
        reply = result.reply
        ok = reply.kind is ReplyKind.RESPONSE and reply.status < 400
        row.status = (BatchLineStatus.DONE if ok else BatchLineStatus.FAILED).value
        row.status_code = reply.status if reply.kind is not ReplyKind.END else 500
        row.result = reply.data or '{"error": {"message": "No answer came back.", "type": "server_error"}}'
        # A line that failed in the engine is free; one that answered is billed once, here: its ledger
        # row's key is the batch id and line.
        plan, day = await pricing.terms(batch.account_id)
        price = line_price(plan.price_per_request_micros, plan.batch_discount_percent) if ok else 0
        usage = reply.usage or contract.Usage()
        ledger: dict[str, Any] = {
            "id": result.request_id, "account_id": batch.account_id, "api_key_id": batch.api_key_id,
            "model": row.model, "endpoint": BATCH_ENDPOINT_PREFIX + ENDPOINTS[batch.endpoint].value,
            "stream": False, "status": (RequestStatus.SUCCEEDED if ok else RequestStatus.FAILED).value,
            "created_at": now, "finished_at": now, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "http_status": row.status_code,
            "billable": ok, "price_micros": price, "plan": plan.name, "quota_day": day,
        }
        session.add(RequestRecord(**ledger))
        rollup.opened(ledger)
        if ok and price:
            # To Stripe's batch meter, priced per plan at the batch discount (the live requests' meter
            # prices every event at the full per-request price); billed once: the row's key is the line's.
            session.add(UsageOutbox(request_id=result.request_id, account_id=batch.account_id, day=day,
                                    created_at=now, status=OutboxStatus.PENDING.value, attempts=0,
                                    next_attempt_at=now, meter=Meter.BATCH.value))
        return ok


class _Pricing:
    """Each account's effective plan and quota day, read once per transaction."""

    def __init__(self, session: AsyncSession, now: datetime) -> None:
        self._session = session
        self._now = now
        self._known: dict[int, tuple[Plan, str]] = {}

    async def terms(self, account_id: int) -> tuple[Plan, str]:
        if account_id not in self._known:
            account = await self._session.get(Account, account_id)
            assert account is not None  # batches reference their account
            plan = await self._session.get(Plan, effective_plan_name(account, self._now))
            assert plan is not None
            self._known[account_id] = (plan, quota_window(plan.timezone, self._now).day)
        return self._known[account_id]
