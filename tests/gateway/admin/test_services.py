"""The admin writes (flatfare.gateway.admin.services), on each database: every one checks the write scope
and records its audit entry in the transaction that makes it, keys and admin tokens included; a 404 or a
refusal writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from flatfare.billing.plan_change import ensure_account
from flatfare.gateway.admin import services
from flatfare.gateway.admin.auth import Admin, Scope
from flatfare.gateway.admin.schemas import (AccountUpdate, KeyCreate, KeyRotate, KeyUpdate, PlanUpdate,
                                            TokenCreate)
from flatfare.gateway.errors import APIError
from flatfare.storage.accounts import issue_admin_token
from flatfare.storage.models import AdminToken, ApiKey, AuditEntry

WRITER = Admin(None, "ops", frozenset({Scope.READ.value, Scope.WRITE.value}))
READER = Admin(None, "dashboards", frozenset({Scope.READ.value}))


async def _account(sessions) -> int:
    async with sessions() as session, session.begin():
        return (await ensure_account(session, "acme", "pro")).id


async def _audit(sessions) -> list[tuple[str, str, str]]:
    async with sessions() as session:
        return [tuple(row) for row in await session.execute(
            select(AuditEntry.actor, AuditEntry.action, AuditEntry.resource_id).order_by(AuditEntry.id))]


async def test_a_read_only_admin_writes_nothing(sessions) -> None:
    account_id = await _account(sessions)
    writes = [services.update_plan(sessions, READER, "pro", PlanUpdate(daily_limit=1)),
              services.update_account(sessions, READER, account_id, AccountUpdate(plan="premium")),
              services.create_key(sessions, READER, account_id, KeyCreate(name="k")),
              services.create_token(sessions, READER, TokenCreate(name="t", scopes=["admin:read"]))]
    for write in writes:
        with pytest.raises(APIError) as refused:
            await write
        assert (refused.value.status, refused.value.code) == (403, "insufficient_scope")
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(ApiKey)) == 0
    assert await _audit(sessions) == []


async def test_key_writes_are_audited_and_a_rotation_keeps_limits_and_expiry(sessions) -> None:
    account_id = await _account(sessions)
    expires = datetime.now(UTC) + timedelta(days=30)
    key, secret = await services.create_key(sessions, WRITER, account_id, KeyCreate(
        name="v1", daily_limit=3, allowed_models=["m"], expires_at=expires))
    assert secret.startswith("ff-")
    await services.update_key(sessions, WRITER, key.id, KeyUpdate(max_inflight=5))
    new, _ = await services.rotate_key(sessions, WRITER, key.id, KeyRotate(grace_seconds=60))
    assert (new.daily_limit, new.allowed_models, new.max_inflight, new.name) == (3, ["m"], 5, "v1")
    assert abs((new.expires_at - expires).total_seconds()) < 1  # a rotation never makes a key immortal
    await services.revoke_key(sessions, WRITER, key.id)
    with pytest.raises(APIError) as refused:
        await services.rotate_key(sessions, WRITER, key.id, KeyRotate())
    assert refused.value.code == "key_revoked"
    with pytest.raises(APIError) as missing:
        await services.revoke_key(sessions, WRITER, 999)
    assert (missing.value.status, missing.value.code) == (404, "key_not_found")
    assert await _audit(sessions) == [("ops", "key.create", str(key.id)), ("ops", "key.update", str(key.id)),
                                      ("ops", "key.create", str(new.id)), ("ops", "key.rotate", str(key.id)),
                                      ("ops", "key.revoke", str(key.id))]


async def test_token_writes_are_audited(sessions) -> None:
    async with sessions() as session, session.begin():
        root, _ = await issue_admin_token(session, "root", ["admin:read", "admin:write"])
    admin = Admin(root.id, "root", frozenset({Scope.READ.value, Scope.WRITE.value}))
    token, secret = await services.create_token(sessions, admin, TokenCreate(name="ci", scopes=["admin:read"]))
    assert secret.startswith("ffa-")
    await services.revoke_token(sessions, admin, token.id)
    async with sessions() as session:
        assert (await session.get(AdminToken, token.id)).revoked_at is not None
    assert await _audit(sessions) == [("root", "token.create", str(token.id)), ("root", "token.revoke", str(token.id))]


async def test_a_plan_takes_shared_key_rules_within_their_limits(sessions) -> None:
    """The shared-key columns (migration 0018) through the admin write: set, audited, cleared by null; a
    value outside its range is refused by the wire model."""
    plan = await services.update_plan(sessions, WRITER, "pro",
                                      PlanUpdate(shared_key_alert_addresses=20, shared_key_max_addresses=5))
    assert (plan.shared_key_alert_addresses, plan.shared_key_max_addresses) == (20, 5)
    assert ("ops", "plan.update", "pro") in await _audit(sessions)
    cleared = await services.update_plan(sessions, WRITER, "pro", PlanUpdate.model_validate(
        {"shared_key_max_addresses": None}))
    assert (cleared.shared_key_alert_addresses, cleared.shared_key_max_addresses) == (20, None)
    for field, value in (("shared_key_alert_addresses", 0), ("shared_key_max_addresses", 10_001)):
        with pytest.raises(ValidationError):
            PlanUpdate.model_validate({field: value})
