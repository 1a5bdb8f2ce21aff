"""OpenAI's Batch API at ``/v1/batches``: batches of chat, completion or embedding requests run on the
batch lane with the capacity live traffic leaves idle, priced at the plan's batch discount.
:data:`router` serves it; the lifespan calls :func:`start` once the Files API is up, which puts the
:class:`~.service.BatchService` on ``app.state.batches`` and returns the dispatcher's task."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.batches.dispatcher import BatchDispatcher
from flatfare.gateway.batches.files import BatchFiles
from flatfare.gateway.batches.routes import router
from flatfare.gateway.batches.service import BatchService

__all__ = ["router", "start"]


def start(state: Any, redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession],
          stop: asyncio.Event) -> asyncio.Task[None]:
    files = BatchFiles(state.files)
    state.batches = BatchService(sessions, files)
    return asyncio.create_task(BatchDispatcher(redis, sessions, files, state.pools).run(stop))
