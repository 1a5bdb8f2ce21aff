"""Stored responses expire (gateway/responses/store.py): one older than the retention reads as absent
(GET, DELETE and previous_response_id all go through ``get``/``delete``) and the purge deletes it; a
fresh one stays. Real SQLite and PostgreSQL, migrated to head."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from flatfare.gateway.responses.store import ResponseStore
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.models import StoredResponse


async def _account(sessions) -> int:
    async with sessions() as session:
        account = await ensure_account(session, "keeper", "pro")
        await session.commit()
        return account.id


async def _count(sessions) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(StoredResponse)) or 0)


async def test_a_response_past_the_retention_reads_as_absent_and_is_purged(sessions) -> None:
    account = await _account(sessions)
    store = ResponseStore(sessions, timedelta(days=30))
    now = datetime.now(UTC)
    for response_id, age in (("resp_old", timedelta(days=31)), ("resp_gone", timedelta(days=30, minutes=1)),
                             ("resp_new", timedelta(days=29))):
        await store.save(account, f"req-{response_id}", now - age, {"id": response_id, "model": "m"}, [])
    assert await store.get(account, "resp_new") is not None
    assert await store.get(account, "resp_old") is None
    assert not await store.delete(account, "resp_gone")  # absent to a DELETE too: a 404
    assert await _count(sessions) == 3  # read as absent before any purge
    assert await store.purge_expired() == 2
    assert await _count(sessions) == 1
    assert await store.get(account, "resp_new") is not None
    assert await store.purge_expired() == 0
