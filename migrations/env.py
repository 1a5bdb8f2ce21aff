"""Alembic environment: the URL comes from the caller (flatfare.storage.db.migrate) or settings."""

from __future__ import annotations

import asyncio

from alembic import context

from flatfare.settings import CommonSettings
from flatfare.storage.db import async_url, create_engine
from flatfare.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or async_url(CommonSettings().resolved_database_url)


def _run(connection) -> None:  # noqa: ANN001 - a sync Connection inside run_sync
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    engine = create_engine(_url(), pool_size=1)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
