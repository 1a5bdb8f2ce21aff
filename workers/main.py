"""``flatfare worker``: one process, one model, one embedded engine."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvloop
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from flatfare.contract import WorkerInfo, WorkerState, pool_name
from flatfare.logs import configure_logging, dict_config
from flatfare.redis_conn import connect
from flatfare.storage.db import brief_sessions
from flatfare.storage.models import CatalogModel
from flatfare.workers.engine import Engine, EngineError, check_gpus, engine_argv
from flatfare.workers.instant import InstantEngine
from flatfare.workers.loop import EngineLike, WorkerLoop
from flatfare.workers.presence import Presence, now_ms
from flatfare.workers.metrics import WorkerMetrics
from flatfare.workers.prepare import resolve_source
from flatfare.workers.settings import WorkerSettings
from flatfare.workers.tokenizer import keep_published, publish_tokenizer, tokenizer_json

log = logging.getLogger("flatfare.worker")

# Options every Flatfare worker gets unless the catalog or the command line says otherwise:
# priority scheduling, so the premium lane's requests also win inside the running batch.
_BASE_OPTIONS: dict[str, Any] = {"disable_log_stats": True, "scheduling_policy": "priority"}


class StartedEngine(EngineLike, Protocol):
    """An engine that says what configuration it started with (:func:`flatfare.workers.engine.effective_config`)."""

    engine_config: dict[str, Any]


class WorkerError(Exception):
    """The worker cannot start as configured; the message says what to change."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)


async def load_spec(settings: WorkerSettings) -> ModelSpec:
    """The model's catalog entry, overridden by the worker's own settings."""
    entry: CatalogModel | None = None
    async with brief_sessions(settings.resolved_database_url) as sessions:
        try:
            async with sessions() as session:
                entry = await session.scalar(select(CatalogModel).where(CatalogModel.name == settings.model))
        except SQLAlchemyError as exc:
            if not settings.source:
                raise WorkerError(f"cannot read the model catalog ({exc.__class__.__name__}); "
                                  "run `flatfare migrate` or pass --source") from exc
    if entry is None and not settings.source:
        raise WorkerError(f"model {settings.model!r} is not in the catalog; add it or pass --source")
    if entry is not None and not entry.enabled:
        raise WorkerError(f"model {settings.model!r} is disabled in the catalog")
    source = settings.source or entry.source
    options = {**_BASE_OPTIONS, **(entry.engine_options if entry else {}), **settings.engine_options}
    return ModelSpec(name=settings.model, source=source, options=options)


async def build_engine(settings: WorkerSettings, progress: Callable[[str], None]) -> tuple[str, StartedEngine, str]:
    """The model's name, its started engine, and the folder or hub id it loaded ("" for the instant engine)."""
    if settings.engine == "instant":
        progress(f"BENCHMARK ENGINE: '{settings.model}' answers with {settings.instant_tokens} filler tokens")
        engine = InstantEngine(settings.instant_tokens, settings.max_inflight or 1024,
                               settings.instant_first_token_delay_s, settings.instant_token_delay_s,
                               settings.instant_start_delay_s)
        await engine.start()
        return settings.model, engine, ""
    spec = await load_spec(settings)
    try:
        check_gpus(spec.options)
    except EngineError as exc:
        raise WorkerError(str(exc)) from exc
    progress(f"preparing model {spec.name}")
    model_path = await asyncio.to_thread(resolve_source, spec.source, settings.models_dir, progress)
    progress(f"starting the engine for {spec.name}")
    engine = Engine(engine_argv(model_path, spec.name, spec.options), engine_metrics=settings.engine_metrics,
                    logging_config=dict_config(settings.log_level, settings.log_format))
    await engine.start()
    return spec.name, engine, model_path


async def serve(settings: WorkerSettings, progress: Callable[[str], None] = log.info) -> None:
    redis = connect(settings.redis_url)
    # Announced as "starting" while the engine loads, so /v1/models can say so.
    info = WorkerInfo(worker_id=settings.worker_id, model=settings.model, max_model_len=0, capacity=0,
                      pool=pool_name(settings.model, settings.pool or None), started_ms=now_ms(),
                      engine=settings.engine, state=WorkerState.STARTING)
    presence = Presence(redis, info)
    presence.start()
    try:
        model, engine, model_path = await build_engine(settings, progress)
    except BaseException:
        await presence.stop()
        await redis.aclose()
        raise
    republish: asyncio.Task[None] | None = None
    if model_path:  # before it is warm: a gateway counting a long prompt for it finds the tokenizer there
        text = await asyncio.to_thread(tokenizer_json, model_path)
        if text is not None:
            if await publish_tokenizer(redis, model, text):
                progress(f"published the tokenizer of {model}")
            republish = asyncio.create_task(keep_published(redis, model, text), name="tokenizer")
    capacity = settings.max_inflight or engine.max_num_seqs
    info.max_model_len, info.capacity = engine.max_model_len, capacity
    # One line and the heartbeat say what the engine really runs with, so an operator sees whether a
    # catalog option took effect (the admin API's model state shows each worker's).
    info.extra["engine_config"] = engine.engine_config
    log.info("engine started: %s", json.dumps(engine.engine_config, sort_keys=True),
             extra={"model": model, "engine_config": engine.engine_config})
    metrics = WorkerMetrics(model)
    if settings.metrics_port >= 0:
        info.extra["metrics_port"] = metrics.serve(settings.metrics_host, settings.metrics_port)
        progress(f"metrics on http://{settings.metrics_host}:{info.extra['metrics_port']}/metrics")
    reserve = settings.premium_reserve if settings.premium_reserve >= 0 else capacity // 8
    loop = WorkerLoop(redis, engine, info, drain_timeout_s=settings.drain_timeout_s, metrics=metrics,
                      lease_s=settings.job_lease_s, presence=presence, premium_reserve=min(reserve, capacity - 1))
    metrics.watch(lambda: len(loop.inflight), capacity, lambda: loop.draining)
    running = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(sig, loop.stop)
    progress(f"worker {info.worker_id} serving {model} (capacity {capacity})")
    try:
        await loop.run()
    finally:
        if republish is not None:
            republish.cancel()
            await asyncio.gather(republish, return_exceptions=True)
        await redis.aclose()
        engine.shutdown()
        metrics.close()


def main(settings: WorkerSettings) -> None:
    if not settings.redis_url:
        raise WorkerError("set FLATFARE_REDIS_URL: a worker needs the Redis its gateway uses")
    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    # uvloop, as in `vllm serve` and the gateway (uvicorn): the stdlib selector loop was half of the
    # worker's CPU under load (bench/results/profile.md).
    uvloop.run(serve(settings))
