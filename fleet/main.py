"""Running a fleet supervisor: its Redis, database and metrics, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop

from flatfare.fleet.metrics import FleetMetrics
from flatfare.fleet.settings import FleetSettings
from flatfare.fleet.supervisor import FleetRunning, Supervisor
from flatfare.logs import configure_logging
from flatfare.redis_conn import connect
from flatfare.storage.db import create_engine, session_factory

log = logging.getLogger("flatfare.fleet")


class FleetError(Exception):
    """The fleet cannot start as configured; the message says what to change."""


async def serve(settings: FleetSettings) -> None:
    redis = connect(settings.redis_url)
    engine = create_engine(settings.resolved_database_url, pool_size=1)
    metrics = FleetMetrics()
    if settings.fleet_metrics_port >= 0:
        port = metrics.serve(settings.fleet_metrics_host, settings.fleet_metrics_port)
        log.info("fleet metrics on http://%s:%d/metrics", settings.fleet_metrics_host, port)
    stop = asyncio.Event()
    running = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(sig, stop.set)
    try:
        await Supervisor(settings, redis, session_factory(engine), metrics).run(stop)
    finally:
        await redis.aclose()
        await engine.dispose()


def main(settings: FleetSettings) -> None:
    if not settings.redis_url:
        raise FleetError("set FLATFARE_REDIS_URL: the fleet's workers need the Redis their gateways use")
    configure_logging(settings.log_level, settings.log_format, log_prompts=settings.log_prompts)
    try:
        uvloop.run(serve(settings))
    except FleetRunning as exc:
        raise FleetError(str(exc)) from exc
