"""Admin route for the fleet supervisors: what each live fleet runs, what waits and why, what it did."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from flatfare import contract
from flatfare.contract import FleetStatus
from flatfare.gateway.admin.auth import AdminReader
from flatfare.gateway.admin.schemas import Page, _Out
from flatfare.gateway.app_state import services_of

router = APIRouter()


class FleetPublic(_Out):
    """One fleet's last heartbeat (``FleetStatus``, contract item 8)."""

    fleet_id: str
    host: str
    accelerator: str
    slots: list[str]
    max_awake: int
    host_memory_gb: float
    # The catalog models it can start, and their LoRA variants.
    models: list[str]
    # worker id -> model, state, slots, pid, last_used_ms, sleep_level, inflight, phase, log.
    engines: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Models with queued requests it cannot serve yet -> why.
    waiting: dict[str, str] = Field(default_factory=dict)
    # Its last decisions, oldest first: t (ms), action, model, worker_id, why.
    decisions: list[dict[str, Any]] = Field(default_factory=list)
    updated_ms: int


@router.get("/fleets", response_model=Page[FleetPublic])
async def list_fleets(request: Request, _: AdminReader) -> dict[str, Any]:
    """Every fleet supervisor whose status has not expired (FLEET_TTL_S), by id."""
    redis = services_of(request).redis
    ids = sorted(i.decode() for i in await redis.zrange(contract.FLEETS_KEY, 0, -1))
    raw = await redis.mget([contract.fleet_key(i) for i in ids]) if ids else []
    fleets = [FleetPublic.model_validate(FleetStatus.decode(r), from_attributes=True) for r in raw if r]
    return {"data": fleets, "has_more": False}
