"""``flatfare fleet``: run this host's fleet supervisor; ``flatfare fleet status``: what every fleet does."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Annotated, Any

import typer

app = typer.Typer(help="The fleet supervisor: models started, woken, put to sleep or stopped on demand.",
                  invoke_without_command=True)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.callback()
def fleet(
    ctx: typer.Context,
    model: Annotated[list[str] | None, typer.Option(
        help="A catalog model this fleet serves (repeat for more). Default: every enabled one that fits.")] = None,
    on_demand: Annotated[bool, typer.Option(
        "--on-demand", help="Keep no model up here, pinned ones included: each waits for a request.")] = False,
    preload: Annotated[list[str] | None, typer.Option(
        help="A model to start at once (then on demand like the rest); repeat for more.")] = None,
    max_awake: Annotated[int | None, typer.Option(
        min=1, help="Engines awake at once. Default: one per GPU; on a CPU host 1 up to 4 cores, else 2.")] = None,
    idle_timeout: Annotated[float | None, typer.Option(
        min=1, help="Seconds an on-demand engine may sit idle before it sleeps (GPU) or stops (CPU).")] = None,
    gpus: Annotated[str | None, typer.Option(
        help="GPU ids this fleet owns, e.g. 0,1 ('cpu': none). Default: CUDA_VISIBLE_DEVICES, else nvidia-smi's.")
    ] = None,
    host_memory_gb: Annotated[float | None, typer.Option(
        min=0, help="Host memory (GiB) for level-1 sleepers' weights. Default: 80 % of what is free.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Port of the fleet's /metrics (0: any free, -1: off).")
                            ] = None,
) -> None:
    """Run this host's fleet supervisor (FLATFARE_REDIS_URL, FLATFARE_DATABASE_URL, FLATFARE_FLEET_*)."""
    if ctx.invoked_subcommand is not None:
        return
    import os

    # Its workers are processes of their own: a multiprocess metrics folder meant for gateways would
    # send the fleet's samples to files nobody reads.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from flatfare.fleet.main import FleetError, main
    from flatfare.fleet.settings import FleetSettings

    given: dict[str, Any] = {"fleet_models": model, "fleet_on_demand": on_demand or None, "fleet_preload": preload,
                             "fleet_max_awake": max_awake, "fleet_idle_timeout_s": idle_timeout, "fleet_gpus": gpus,
                             "fleet_host_memory_gb": host_memory_gb, "fleet_metrics_port": metrics_port}
    try:
        main(FleetSettings(**{k: v for k, v in given.items() if v is not None}))
    except FleetError as exc:
        _fail(str(exc))


@app.command("status")
def status(as_json: Annotated[bool, typer.Option("--json", help="The fleets' status as JSON.")] = False) -> None:
    """Every live fleet: its budget, engines, models waiting and why, and its last decisions."""
    from flatfare.fleet.status import read_fleets, render
    from flatfare.redis_conn import REDIS_DOWN, connect
    from flatfare.settings import CommonSettings

    settings = CommonSettings()
    if not settings.redis_url:
        _fail("set FLATFARE_REDIS_URL: fleets publish their status in Redis")

    async def read() -> list[Any]:
        redis = connect(settings.redis_url)
        try:
            return await read_fleets(redis)
        finally:
            await redis.aclose()

    try:
        fleets = asyncio.run(read())
    except REDIS_DOWN as exc:
        _fail(f"cannot reach Redis at {settings.redis_url} ({exc.__class__.__name__})")
    typer.echo(json.dumps([asdict(f) for f in fleets], indent=2) if as_json else render(fleets))
