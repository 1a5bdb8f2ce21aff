"""``flatfare worker``: one process, one model, one embedded engine."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil
import redis.asyncio as aioredis
import uvloop
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from flatfare import contract, tracing
from flatfare.contract import ModelFacts, WorkerInfo, WorkerState, pool_name
from flatfare.logs import configure_logging, dict_config
from flatfare.redis_conn import REDIS_DOWN, connect
from flatfare.storage.db import brief_sessions
from flatfare.storage.models import CatalogModel
from flatfare.workers.engine import Engine, EngineError, check_gpus, engine_argv
from flatfare.workers.instant import InstantEngine
from flatfare.workers.loop import EngineLike, WorkerLoop
from flatfare.workers.phases import PREPARING, STARTING_ENGINE, StartProgress, with_phase_log
from flatfare.workers.presence import Presence, now_ms
from flatfare.workers.metrics import WorkerMetrics
from flatfare.workers.pace import PaceGovernor
from flatfare.workers.prepare import resolve_source
from flatfare.workers.settings import WorkerSettings
from flatfare.workers.tokenizer import keep_published, publish_tokenizer, tokenizer_json
from flatfare.workers.variants import Variants

log = logging.getLogger("flatfare.worker")

# Options every Flatfare worker gets unless the catalog or the command line says otherwise:
# priority scheduling, so the premium lane's requests also win inside the running batch.
_BASE_OPTIONS: dict[str, Any] = {"disable_log_stats": True, "scheduling_policy": "priority"}
# The pace governor's factor on an accelerator (WorkerSettings.pace_slack).
DEFAULT_PACE_SLACK = 1.3


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
    if entry is not None and entry.base_model:
        raise WorkerError(f"model {settings.model!r} is a LoRA variant of {entry.base_model!r}: the workers of "
                          f"{entry.base_model!r} serve it; start one of those")
    source = settings.source or entry.source
    options = {**_BASE_OPTIONS, **(entry.engine_options if entry else {}), **settings.engine_options}
    return ModelSpec(name=settings.model, source=source, options=options)


async def build_engine(settings: WorkerSettings, progress: Callable[[str], None],
                       start: StartProgress) -> tuple[str, StartedEngine, str]:
    """The model's name, its started engine, and the folder or hub id it loaded ("" for the instant engine)."""
    if settings.engine == "instant":
        progress(f"BENCHMARK ENGINE: '{settings.model}' answers with {settings.instant_tokens} filler tokens")
        engine = InstantEngine(settings.instant_tokens, settings.max_inflight or 1024,
                               settings.instant_first_token_delay_s, settings.instant_token_delay_s,
                               settings.instant_start_delay_s, settings.instant_sleep_delay_s,
                               settings.instant_wake_delay_s)
        start.enter(STARTING_ENGINE)
        await engine.start()
        return settings.model, engine, ""
    spec = await load_spec(settings)
    try:
        check_gpus(spec.options)
    except EngineError as exc:
        raise WorkerError(str(exc)) from exc
    progress(f"preparing model {spec.name}")
    start.enter(PREPARING)
    model_path = await asyncio.to_thread(resolve_source, spec.source, settings.models_dir, progress)
    progress(f"starting the engine for {spec.name}")
    start.enter(STARTING_ENGINE)
    logging_config = dict_config(settings.log_level, settings.log_format)
    if start.phase_log is not None:
        logging_config = with_phase_log(logging_config, start.phase_log)
    variants = Variants(settings.resolved_database_url, spec.name, settings.models_dir) \
        if spec.options.get("enable_lora") else None
    engine = Engine(engine_argv(model_path, spec.name, spec.options), engine_metrics=settings.engine_metrics,
                    logging_config=logging_config, sleep_mode=settings.sleep_mode,
                    variants=variants.adapter if variants is not None else None,
                    pace=None if settings.pace_slack < 0 else settings.pace_slack > 0)
    await engine.start()
    if variants is not None:
        await load_variants(engine, variants, progress)
    return spec.name, engine, model_path


async def load_variants(engine: Engine, variants: Variants, progress: Callable[[str], None]) -> None:
    """Load the catalog's LoRA variants of the model; one that fails is logged and tried again when a
    request names it, and the worker serves the rest."""
    for name, adapter in (await variants.all()).items():
        try:
            await engine.load_variant(name, adapter)
        except EngineError as exc:
            log.error("%s", exc)
        else:
            progress(f"loaded the LoRA variant {name}")


def _process_age_s() -> float:
    """Seconds since this process started: a start's measure includes imports and preparing the model."""
    return time.time() - psutil.Process().create_time()


async def _expected_start_s(redis: aioredis.Redis, model: str) -> float:
    try:
        return ModelFacts.from_fields(await redis.hgetall(contract.model_facts_key(model))).start_s
    except REDIS_DOWN:
        return 0.0


async def serve(settings: WorkerSettings, progress: Callable[[str], None] = log.info) -> None:
    redis = connect(settings.redis_url)
    # Announced as "starting" while the engine loads, so /v1/models can say so.
    info = WorkerInfo(worker_id=settings.worker_id, model=settings.model, max_model_len=0, capacity=0,
                      pool=pool_name(settings.model, settings.pool or None), started_ms=now_ms(),
                      engine=settings.engine, state=WorkerState.STARTING, fleet=settings.fleet_id)
    expected_s = await _expected_start_s(redis, settings.model)
    if expected_s:
        info.extra["expected_start_s"] = expected_s
    presence = Presence(redis, info)
    with tempfile.TemporaryDirectory(prefix="flatfare-start-") as folder:
        start = StartProgress(settings.redis_url, info, Path(folder) / "vllm.log")
        start.start()
        try:
            model, engine, model_path = await build_engine(settings, progress, start)
        except BaseException:
            start.stop()
            await presence.stop()
            await redis.aclose()
            raise
        start.stop()
    presence.start()
    republish: asyncio.Task[None] | None = None
    if model_path:  # before it is warm: a gateway counting a long prompt for it finds the tokenizer there
        text = await asyncio.to_thread(tokenizer_json, model_path)
        if text is not None:
            if await publish_tokenizer(redis, model, text):
                progress(f"published the tokenizer of {model}")
            republish = asyncio.create_task(keep_published(redis, model, text), name="tokenizer")
    capacity = settings.max_inflight or engine.max_num_seqs
    info.max_model_len, info.capacity = engine.max_model_len, capacity
    info.extra["sleep_mode"] = not engine.sleep_unavailable
    if engine.sleep_unavailable:
        info.extra["sleep_unavailable"] = engine.sleep_unavailable
    start_s = round(_process_age_s(), 3)
    try:
        await presence.record_facts(ModelFacts(max_model_len=engine.max_model_len, start_s=start_s))
    except REDIS_DOWN:
        log.warning("could not record the start time of %s", model)
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
    on_cpu = getattr(engine, "device_type", "") == "cpu"
    batch_slots = settings.batch_slots if settings.batch_slots >= 0 else (1 if on_cpu else None)
    batch_while_live = settings.batch_while_live if settings.batch_while_live >= 0 else (0 if on_cpu else None)
    reserve = min(reserve, capacity - 1)
    # By device: an accelerator's engine (not the CPU's, nor the instant engine, which has no pace).
    on_accelerator = getattr(engine, "device_type", "") not in ("", "cpu")
    slack = settings.pace_slack if settings.pace_slack >= 0 else (DEFAULT_PACE_SLACK if on_accelerator else 0.0)
    governor = PaceGovernor(ceiling=capacity - reserve, slack=slack,
                            floor=settings.pace_floor or max(capacity // 64, 4)) if slack > 0 else None
    loop = WorkerLoop(redis, engine, info, drain_timeout_s=settings.drain_timeout_s, metrics=metrics,
                      lease_s=settings.job_lease_s, presence=presence, premium_reserve=reserve,
                      batch_slots=batch_slots, batch_while_live=batch_while_live, governor=governor,
                      tracer=tracing.tracer("flatfare-worker", settings.traces_endpoint, settings.traces_sample_ratio))
    metrics.watch(lambda: len(loop.inflight), capacity, lambda: loop.draining)
    running = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(sig, loop.stop)
    progress(f"worker {info.worker_id} serving {model} (capacity {capacity}"
             + (f", pace governed within {slack:g}x)" if governor is not None else ")"))
    try:
        await loop.run()
    finally:
        if republish is not None:
            republish.cancel()
            await asyncio.gather(republish, return_exceptions=True)
        await redis.aclose()
        engine.shutdown()
        metrics.close()
        if loop.tracer is not None:
            loop.tracer.shutdown()


def main(settings: WorkerSettings) -> None:
    if not settings.redis_url:
        raise WorkerError("set FLATFARE_REDIS_URL: a worker needs the Redis its gateway uses")
    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    # uvloop, as in `vllm serve` and the gateway (uvicorn): the stdlib selector loop was half of the
    # worker's CPU under load (bench/results/profile.md).
    uvloop.run(serve(settings))
