"""Database engines, sessions and migrations, for SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

# migrations/ in the repository, installed as this package (pyproject.toml maps it, in a wheel as in
# an editable install): found through the import system, never beside the source tree.
MIGRATIONS_PACKAGE = "flatfare.migrations"

# What the database being away raises: SQLAlchemy's errors, and asyncpg's refused connection, which is a
# bare OSError.
DATABASE_DOWN: tuple[type[Exception], ...] = (SQLAlchemyError, OSError)

log = logging.getLogger("flatfare.storage")


async def expire_every(stop: asyncio.Event, every_s: float, expire: Callable[[], Awaitable[int]], what: str) -> None:
    """Until ``stop``, every ``every_s``: ``expire()`` deletes what is past its time and says how much (run
    in every gateway process: a delete twice deletes once). A database that is away is tried next time."""
    while not stop.is_set():
        try:
            if gone := await expire():
                log.info("expired %s deleted", what, extra={what: gone})
        except DATABASE_DOWN as exc:
            log.warning("expired %s not deleted: %s", what, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def async_url(url: str) -> str:
    """Turn a plain ``postgresql://`` or ``sqlite:///`` URL into its asyncio driver's form."""
    parsed = make_url(url)
    if "+" not in parsed.drivername and parsed.drivername in _ASYNC_DRIVERS:
        parsed = parsed.set(drivername=_ASYNC_DRIVERS[parsed.drivername])
    return parsed.render_as_string(hide_password=False)


def create_engine(url: str, *, pool_size: int = 20) -> AsyncEngine:
    url = async_url(url)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def sqlite_pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI types
    # WAL lets the gateway read while another process (the CLI, a second gateway) writes.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # In WAL mode NORMAL syncs at checkpoints, not at every commit: no corruption on a crash, and
    # no fsync on the request path (production ledgers belong on PostgreSQL anyway).
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def brief_sessions(url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions for a short task (a CLI command, a worker reading its catalog entry) on an engine of one
    pooled connection that is disposed when the block ends."""
    engine = create_engine(url, pool_size=1)
    try:
        yield session_factory(engine)
    finally:
        await engine.dispose()


@asynccontextmanager
async def one_session(url: str) -> AsyncIterator[AsyncSession]:
    """One session of :func:`brief_sessions`."""
    async with brief_sessions(url) as sessions, sessions() as session:
        yield session


def migrations_dir() -> Path:
    """The folder of alembic's env.py and versions/, wherever Flatfare is installed."""
    return Path(str(resources.files(MIGRATIONS_PACKAGE)))


def alembic_config(url: str):  # noqa: ANN201 - alembic is imported lazily
    """Alembic's configuration without an alembic.ini (that file is for running ``alembic`` by hand in
    a checkout): a wheel carries no file outside its packages."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (blocking; alembic runs its own event loop, so from
    inside a running loop it runs in a thread of its own)."""
    from alembic import command

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        command.upgrade(alembic_config(url), revision)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(command.upgrade, alembic_config(url), revision).result()
