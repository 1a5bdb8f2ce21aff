"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from flatfare.redis_conn import REDIS_DOWN
from flatfare.storage.db import DATABASE_DOWN
from flatfare.gateway.app_state import services_of

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when the database and Redis answer and every served model has a live worker."""
    state = services_of(request)
    checks: dict[str, Any] = {}
    try:
        async with state.sessions() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except DATABASE_DOWN as exc:
        checks["database"] = f"unreachable: {exc.__class__.__name__}"
    try:
        await state.redis.ping()
        checks["redis"] = "ok"
    except REDIS_DOWN as exc:
        checks["redis"] = f"unreachable: {exc.__class__.__name__}"
    if checks["database"] == "ok" and checks["redis"] == "ok":
        models: dict[str, str] = {}
        for entry in (await state.pools.catalog()).values():
            if entry.enabled and entry.min_workers > 0:
                live = await state.pools.warm_workers(entry.name)
                models[entry.name] = f"{len(live)} live worker(s)" if live else "no live worker"
        checks["models"] = models
    ready = (checks["database"] == "ok" and checks["redis"] == "ok"
             and all(v != "no live worker" for v in checks.get("models", {}).values()))
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)
