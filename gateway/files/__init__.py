"""OpenAI's Files API at ``/v1/files``: :data:`router` serves it; the lifespan calls :func:`start` once
the database is open, which puts the :class:`~.service.FileService` on ``app.state.files`` and returns
its expiry sweeper's task."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.files.routes import router
from flatfare.gateway.files.service import FileLimits, FileService
from flatfare.gateway.files.storage import open_store
from flatfare.gateway.settings import GatewaySettings
from flatfare.storage.db import expire_every

__all__ = ["router", "start"]


def start(state: Any, settings: GatewaySettings, sessions: async_sessionmaker[AsyncSession],
          stop: asyncio.Event) -> asyncio.Task[None]:
    limits = FileLimits(settings.files_max_bytes, settings.files_account_max_bytes, settings.files_account_max_files)
    # Uploads spool in the data folder, not the system's temporary one, which may be memory (tmpfs).
    spool = settings.data_dir / "uploads"
    spool.mkdir(parents=True, exist_ok=True)
    state.files = FileService(sessions, open_store(settings), limits, spool)
    return asyncio.create_task(expire_every(stop, settings.files_sweep_interval_s, state.files.sweep, "files"))
