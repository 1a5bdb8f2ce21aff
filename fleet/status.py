"""``flatfare fleet status``: every live fleet's status from Redis, as a table a person reads."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import redis.asyncio as aioredis

from flatfare import contract
from flatfare.contract import FleetStatus

DECISIONS_SHOWN = 10


async def read_fleets(redis: aioredis.Redis) -> list[FleetStatus]:
    """The fleets whose status has not expired, by id."""
    ids = sorted(i.decode() for i in await redis.zrange(contract.FLEETS_KEY, 0, -1))
    if not ids:
        return []
    raw = await redis.mget([contract.fleet_key(i) for i in ids])
    return [FleetStatus.decode(r) for r in raw if r]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def _ago(ms: int, now_ms: int) -> str:
    if not ms:
        return "never"
    seconds = max(now_ms - ms, 0) / 1000
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def render(fleets: list[FleetStatus], now_ms: int | None = None) -> str:
    now_ms = now_ms or int(time.time() * 1000)
    if not fleets:
        return "no fleet is running (start one with `flatfare fleet`)"
    out: list[str] = []
    for fleet in fleets:
        awake = sum(1 for e in fleet.engines.values() if e["state"] not in ("asleep",))
        out.append(f"fleet {fleet.fleet_id} on {fleet.host}: {fleet.accelerator} slots {','.join(fleet.slots)}, "
                   f"{awake} of {fleet.max_awake} awake, {fleet.host_memory_gb:g} GiB for level-1 sleepers, "
                   f"a decision every {fleet.tick_s:g} s (updated {_ago(fleet.updated_ms, now_ms)})")
        out.append(f"  models: {', '.join(fleet.models) or '(none)'}")
        if fleet.engines:
            rows = [[wid, e["model"], e["state"] + (f" (level {e['sleep_level']})" if e.get("sleep_level") else ""),
                     ",".join(e.get("slots") or []) or "-", str(e.get("inflight", 0)),
                     _ago(int(e.get("last_used_ms") or 0), now_ms), str(e.get("phase") or "")]
                    for wid, e in sorted(fleet.engines.items(), key=lambda kv: (kv[1]["model"], kv[0]))]
            out += ["  " + line for line in _table(["engine", "model", "state", "slots", "jobs", "used", "doing"], rows)]
        else:
            out.append("  engines: none")
        for model, why in sorted(fleet.waiting.items()):
            out.append(f"  waiting: {model}: {why}")
        if fleet.decisions:
            out.append("  last decisions:")
            for d in fleet.decisions[-DECISIONS_SHOWN:]:
                when = datetime.fromtimestamp(d["t"] / 1000, UTC).strftime("%H:%M:%S")
                out.append(f"    {when} {d['action']} {d['model']}: {d['why']}")
        out.append("")
    return "\n".join(out).rstrip()
