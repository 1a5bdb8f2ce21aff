"""The request ledger: one row per accepted request, opened when it is queued, closed when it ends.

Closing a billable request of a paid plan writes its meter event to the outbox in the same
transaction, so usage reported to Stripe can never disagree with the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.models import OutboxStatus, RequestRecord, RequestStatus, UsageOutbox


@dataclass(frozen=True, slots=True)
class Charge:
    """What an admitted request costs: the plan's flat price, whatever its length."""

    plan: str
    price_micros: int
    quota_day: str


@dataclass(slots=True)
class Outcome:
    status: RequestStatus
    http_status: int
    queue_ms: int | None = None
    ttft_ms: int | None = None
    duration_ms: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    # False when the request failed before its first token: its quota unit is given back.
    billable: bool = True


class DuplicateIdempotencyKey(Exception):
    """The account already sent a request with this Idempotency-Key."""


class Ledger:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def open(self, *, request_id: str, account_id: int, api_key_id: int, model: str, endpoint: str,
                   stream: bool, created_at: datetime, charge: Charge | None = None,
                   idempotency_key: str | None = None, body_sha256: str | None = None) -> None:
        async with self._sessions() as session:
            session.add(RequestRecord(
                id=request_id, account_id=account_id, api_key_id=api_key_id, model=model, endpoint=endpoint,
                stream=stream, status=RequestStatus.QUEUED.value, created_at=created_at,
                prompt_tokens=0, completion_tokens=0, billable=charge is not None,
                price_micros=charge.price_micros if charge else 0, plan=charge.plan if charge else None,
                quota_day=charge.quota_day if charge else None, idempotency_key=idempotency_key,
                body_sha256=body_sha256,
            ))
            try:
                await session.commit()
            except IntegrityError as exc:
                if idempotency_key is not None:
                    raise DuplicateIdempotencyKey(idempotency_key) from exc
                raise

    async def close(self, request_id: str, outcome: Outcome) -> None:
        now = datetime.now(UTC)
        async with self._sessions() as session, session.begin():
            row = await session.get(RequestRecord, request_id, with_for_update=True)
            if row is None or row.status != RequestStatus.QUEUED.value:
                return  # already closed: a late duplicate changes nothing
            billable = row.billable and outcome.billable
            await session.execute(
                update(RequestRecord).where(RequestRecord.id == request_id).values(
                    status=outcome.status.value, http_status=outcome.http_status, finished_at=now,
                    queue_ms=outcome.queue_ms, ttft_ms=outcome.ttft_ms, duration_ms=outcome.duration_ms,
                    prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                    error_code=outcome.error_code, billable=billable,
                ))
            if billable and row.price_micros > 0:
                session.add(UsageOutbox(request_id=request_id, account_id=row.account_id, day=row.quota_day or "",
                                        created_at=now, status=OutboxStatus.PENDING.value, attempts=0,
                                        next_attempt_at=now))

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

    async def billable_counts(self, days: list[str]) -> dict[tuple[int, str], int]:
        """Billable requests per (account, quota day): what the quota counters must say."""
        async with self._sessions() as session:
            rows = await session.execute(
                select(RequestRecord.account_id, RequestRecord.quota_day, func.count())
                .where(RequestRecord.billable.is_(True), RequestRecord.quota_day.in_(days))
                .group_by(RequestRecord.account_id, RequestRecord.quota_day))
            return {(account_id, day): count for account_id, day, count in rows}


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
