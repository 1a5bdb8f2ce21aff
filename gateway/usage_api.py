"""``GET /v1/usage``: a developer's own allowance today (the account's and each key's) and their last
30 days."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request

from flatfare import contract
from flatfare.billing.ledger import daily_usage
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import QuotaUnavailable
from flatfare.storage.accounts import active_keys
from flatfare.redis_conn import REDIS_DOWN
from flatfare.gateway.deps import CurrentCaller
from flatfare.gateway.errors import ERROR_RESPONSES, APIError
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/v1", tags=["account"], responses=ERROR_RESPONSES)
HISTORY_DAYS = 30


async def inflight(redis: aioredis.Redis, account_id: int, key_ids: list[int],
                   now: datetime) -> tuple[int, dict[int, int]]:
    """Requests in flight now, the account's and each key's: the entries of their in-flight sets that
    have not expired (an entry whose score is now or earlier no longer counts, as in admission)."""
    live = f"({int(now.timestamp() * 1000)}"
    async with redis.pipeline(transaction=False) as pipe:
        for key in [contract.inflight_key(account_id), *map(contract.key_inflight_key, key_ids)]:
            pipe.zcount(key, live, "+inf")
        account, *keys = await pipe.execute()
    return account, dict(zip(key_ids, keys, strict=True))


@router.get("/usage")
async def usage(request: Request, caller: CurrentCaller) -> dict[str, Any]:
    state = services_of(request)
    now = datetime.now(UTC)
    terms = await state.plans.terms(caller.account, now)
    window = quota_window(terms.plan.timezone, now)
    async with state.sessions() as session:
        keys = await active_keys(session, caller.account_id)
    try:
        used = await state.quota.used(caller.account_id, window.day)
        by_key = await state.quota.used_by_keys([key.id for key in keys], window.day)
        running, running_by_key = await inflight(state.redis, caller.account_id, [key.id for key in keys], now)
    except (QuotaUnavailable, *REDIS_DOWN):
        raise APIError(503, "Usage cannot be read right now; retry shortly.", code="quota_unavailable") from None
    today = date.fromisoformat(window.day)
    days = [(today - timedelta(days=offset)).isoformat() for offset in range(HISTORY_DAYS - 1, -1, -1)]
    return {
        "object": "usage",
        "account": caller.account_name,
        "plan": terms.plan.name,
        # Requests queued or running now, and the cap past which new ones get 429 (None: no cap).
        "inflight": running,
        "max_inflight": terms.max_inflight,
        "today": {
            "day": window.day,
            "requests": used,
            "limit": terms.daily_limit,
            "remaining": None if terms.daily_limit is None else max(terms.daily_limit - used, 0),
            "resets_at": window.resets_at.isoformat(),
            "keys": [{"id": key.id, "name": key.name, "prefix": key.prefix, "requests": by_key[key.id],
                      "limit": key.daily_limit,
                      "remaining": None if key.daily_limit is None else max(key.daily_limit - by_key[key.id], 0),
                      "inflight": running_by_key[key.id], "max_inflight": key.max_inflight,
                      "allowed_models": key.allowed_models,
                      "expires_at": key.expires_at.isoformat() if key.expires_at else None} for key in keys],
        },
        "price_per_request_micros": terms.plan.price_per_request_micros,
        "daily": await daily_usage(state.sessions, caller.account_id, days),
    }
