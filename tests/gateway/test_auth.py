"""API-key authentication on real SQL: what the key row says reaches the caller's limits."""

from __future__ import annotations

from flatfare.gateway.auth import Authenticator
from flatfare.storage.accounts import KeyLimitsUpdate, issue_key
from flatfare.billing.plan_change import ensure_account


async def test_a_keys_own_limits_reach_the_caller(sessions) -> None:
    async with sessions() as session:
        account = await ensure_account(session, "acme", "pro")
        capped = await issue_key(session, account, "batch", KeyLimitsUpdate(allowed_models=["m1"], daily_limit=50,
                                                                             max_inflight=3))
        plain = await issue_key(session, account, "web")
        await session.commit()
    auth = Authenticator(sessions, ttl_s=0.0)
    key = (await auth.authenticate(f"Bearer {capped.secret}")).key
    assert (key.name, key.allowed_models, key.daily_limit, key.max_inflight) == ("batch", ("m1",), 50, 3)
    key = (await auth.authenticate(f"Bearer {plain.secret}")).key
    assert (key.allowed_models, key.daily_limit, key.max_inflight) == (None, None, None)
