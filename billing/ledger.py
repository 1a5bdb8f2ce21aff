"""The request ledger: one row per accepted request, opened when it is queued, closed when it ends."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.models import RequestRecord, RequestStatus


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


class Ledger:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def open(self, *, request_id: str, account_id: int, api_key_id: int, model: str, endpoint: str,
                   stream: bool, created_at: datetime) -> None:
        async with self._sessions() as session:
            session.add(RequestRecord(
                id=request_id, account_id=account_id, api_key_id=api_key_id, model=model, endpoint=endpoint,
                stream=stream, status=RequestStatus.QUEUED.value, created_at=created_at,
                prompt_tokens=0, completion_tokens=0,
            ))
            await session.commit()

    async def close(self, request_id: str, outcome: Outcome) -> None:
        async with self._sessions() as session:
            await session.execute(
                update(RequestRecord)
                .where(RequestRecord.id == request_id, RequestRecord.status == RequestStatus.QUEUED.value)
                .values(
                    status=outcome.status.value, http_status=outcome.http_status,
                    finished_at=datetime.now(UTC), queue_ms=outcome.queue_ms, ttft_ms=outcome.ttft_ms,
                    duration_ms=outcome.duration_ms, prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens, error_code=outcome.error_code,
                )
            )
            await session.commit()
