"""OpenAI's Files API at ``/v1/files``: :data:`router` serves it; the lifespan calls :func:`start` once
the database is open, which returns the :class:`~.service.FileService` (the app's ``services.files``)
and its expiry sweeper's task."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.files.routes import router
from flatfare.gateway.files.service import FileLimits, FileService
from flatfare.gateway.files.storage import open_store
from flatfare.gateway.settings import GatewaySettings
from flatfare.storage.db import expire_every

__all__ = ["router", "start"]


def start(settings: GatewaySettings, sessions: async_sessionmaker[AsyncSession],
          stop: asyncio.Event) -> tuple[FileService, asyncio.Task[None]]:
    limits = FileLimits(settings.files_max_bytes, settings.files_account_max_bytes, settings.files_account_max_files)
    # Uploads spool in the data folder, not the system's temporary one, which may be memory (tmpfs).
    spool = settings.data_dir / "uploads"
    spool.mkdir(parents=True, exist_ok=True)
    files = FileService(sessions, open_store(settings), limits, spool)
    return files, asyncio.create_task(expire_every(stop, settings.files_sweep_interval_s, files.sweep, "files"),
                                      name="files-expiry")
