"""The short-lived sessions of commands that run once (flatfare.storage.db.brief_sessions, one_session) and
the key they issue (flatfare.storage.accounts.create_key), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from flatfare.storage.accounts import AccountError
from flatfare.cli.keys import create_key
from flatfare.storage.db import DATABASE_DOWN, brief_sessions, one_session
from flatfare.storage.keys import hash_key
from flatfare.storage.models import Account, ApiKey
from flatfare.redis_local import free_port
from tests.conftest import postgres_database, sync_url

DEADLINE_S = 30.0


async def test_create_key_commits_the_account_and_its_key(database_url: str) -> None:
    secret = await create_key(database_url, "acme", "pro", "ci")
    again = await create_key(database_url, "acme", name="second")  # the account exists: its plan stays
    async with one_session(database_url) as session:  # a new engine: only what was committed
        account = await session.scalar(select(Account).where(Account.name == "acme"))
        key = await session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(secret)))
        keys = await session.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.account_id == account.id))
    assert account.plan == "pro"
    assert key is not None and key.account_id == account.id and key.name == "ci"
    assert keys == 2 and again != secret


async def test_create_key_refuses_an_unknown_plan_and_writes_nothing(database_url: str) -> None:
    with pytest.raises(AccountError, match="Unknown plan 'gold'"):
        await create_key(database_url, "nobody", "gold")
    async with one_session(database_url) as session:
        assert await session.scalar(select(Account).where(Account.name == "nobody")) is None


@pytest.fixture
def postgres_url() -> Iterator[str]:
    yield from postgres_database()


def _connections(url: str) -> int:
    """Sessions open on ``url``'s database, other than the one asking."""
    engine = create_sync_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT count(*) FROM pg_stat_activity "
                                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    finally:
        engine.dispose()


async def _until_no_connections(url: str) -> int:
    """0 once the server has seen every connection to ``url``'s database close; else the count at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while (left := await asyncio.to_thread(_connections, url)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return left


@pytest.mark.postgres
async def test_brief_sessions_close_their_connection_when_the_block_ends(postgres_url: str) -> None:
    async with brief_sessions(postgres_url) as sessions, sessions() as session:
        assert await session.scalar(text("SELECT 1")) == 1
        assert await asyncio.to_thread(_connections, postgres_url) == 1  # one pooled connection
    assert await _until_no_connections(postgres_url) == 0


@pytest.mark.postgres
async def test_one_session_closes_its_connection_when_the_block_fails(postgres_url: str) -> None:
    with pytest.raises(ZeroDivisionError):
        async with one_session(postgres_url) as session:
            await session.scalar(text("SELECT 1"))
            1 / 0  # noqa: B018 - the failure inside the block
    assert await _until_no_connections(postgres_url) == 0


@pytest.mark.postgres
async def test_a_refused_database_connection_is_database_down(postgres_url: str) -> None:
    # Nothing listens on the port: asyncpg's refusal is a bare OSError, not a SQLAlchemyError.
    refused = make_url(postgres_url).set(host="127.0.0.1", port=free_port()).render_as_string(hide_password=False)
    with pytest.raises(DATABASE_DOWN):
        async with one_session(refused) as session:
            await session.scalar(text("SELECT 1"))
