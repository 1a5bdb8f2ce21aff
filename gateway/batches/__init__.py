"""OpenAI's Batch API at ``/v1/batches``: batches of chat, completion or embedding requests run on the
batch lane with the capacity live traffic leaves idle, priced at the plan's batch discount.
:data:`router` serves it; the lifespan calls :func:`start` once the Files API is up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.batches.dispatcher import BatchDispatcher
from flatfare.tracing import Tracer
from flatfare.gateway.batches.files import BatchFiles
from flatfare.gateway.batches.routes import router
from flatfare.gateway.batches.service import BatchService
from flatfare.gateway.files.service import FileService
from flatfare.gateway.openai.admission import Admission
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.jobpath.pools import Pools

__all__ = ["router", "start"]


def start(redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession], files: FileService, pools: Pools,
          admission: Admission, plans: PlanBook, stop: asyncio.Event,
          on_line: Callable[[str, bool], None] | None = None,
          tracer: Tracer | None = None) -> tuple[BatchService, asyncio.Task[None]]:
    """The Batch API's service (the app's ``services.batches``) and its dispatcher's task; ``on_line`` is told
    of each line recorded (its model, whether it was answered); ``tracer``: Flatfare's spans (None: off)."""
    batch_files = BatchFiles(files)
    dispatcher = BatchDispatcher(redis, sessions, batch_files, pools, admission, plans, on_line=on_line,
                                 tracer=tracer)
    return BatchService(sessions, batch_files, redis), asyncio.create_task(dispatcher.run(stop), name="batch-dispatcher")
