"""Stored responses in SQL, each owned by its account: saved when a ``store`` response finishes, read
back by any gateway process. Another account's response reads as absent, as OpenAI answers it, and so
does one older than the retention (``responses_retention_days``, 30 as OpenAI keeps them), which every
gateway process also deletes now and then."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.storage.models import StoredResponse

# Rows one purge deletes at most (the next pass takes the rest).
PURGE_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Kept:
    """One stored response: the object as it went out, and every input item the model was given."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    # Its size as stored (the JSON of both): what continuing it adds to a request.
    size: int = 0


class ResponseStore:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], retention: timedelta = timedelta(days=30)) -> None:
        self._sessions = sessions
        self.retention = retention

    def _oldest_kept(self, now: datetime | None = None) -> datetime:
        return (now or datetime.now(UTC)) - self.retention

    async def save(self, account_id: int, request_id: str, created_at: datetime, response: dict[str, Any],
                   input_items: list[dict[str, Any]]) -> None:
        """Keep ``response``; a replay of the same request (its Idempotency-Key) keeps the first copy."""
        row = StoredResponse(id=response["id"], account_id=account_id, request_id=request_id,
                             model=str(response.get("model") or ""), created_at=created_at,
                             response=orjson.dumps(response).decode(), input_items=orjson.dumps(input_items).decode())
        try:
            async with self._sessions.begin() as session:
                session.add(row)
        except IntegrityError:
            pass  # stored already, by the first answer of this idempotent request

    async def get(self, account_id: int, response_id: str) -> Kept | None:
        async with self._sessions() as session:
            row = (await session.execute(select(StoredResponse.response, StoredResponse.input_items).where(
                StoredResponse.id == response_id, StoredResponse.account_id == account_id,
                StoredResponse.created_at > self._oldest_kept()))).first()
        if row is None:
            return None
        return Kept(orjson.loads(row.response), orjson.loads(row.input_items), len(row.response) + len(row.input_items))

    async def delete(self, account_id: int, response_id: str) -> bool:
        async with self._sessions.begin() as session:
            result = await session.execute(delete(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.account_id == account_id,
                StoredResponse.created_at > self._oldest_kept()))
        return bool(result.rowcount)

    async def purge_expired(self, now: datetime | None = None) -> int:
        """Delete the responses past the retention, PURGE_BATCH a statement; how many went."""
        oldest_kept = self._oldest_kept(now)
        purged = 0
        while True:
            async with self._sessions.begin() as session:
                expired = select(StoredResponse.id).where(StoredResponse.created_at <= oldest_kept).limit(PURGE_BATCH)
                gone = int((await session.execute(delete(StoredResponse).where(StoredResponse.id.in_(expired))))
                           .rowcount or 0)
            purged += gone
            if gone < PURGE_BATCH:
                return purged
