"""The admin console's routes (flatfare.gateway.console.admin) in one gateway process (tests/gateway/rig.py):
every page renders for an admin token, and a read-only token's write is refused before its form is read.
The pages' content and writes in a real browser, on the shared stack: tests/console/test_admin_pages.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from flatfare.storage.accounts import issue_admin_token
from flatfare.storage.db import create_engine, session_factory
from tests.console.conftest import CSRF
from tests.gateway.rig import Gateway, in_process_gateway


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path, local_mode=True) as gateway:
        yield gateway


async def _admin(gateway: Gateway, scopes: list[str]) -> tuple[httpx.AsyncClient, str]:
    """The rig's client logged in to the admin console with a new token of ``scopes``; its CSRF token."""
    engine = create_engine(gateway.database_url)
    try:
        async with session_factory(engine)() as session, session.begin():
            _, secret = await issue_admin_token(session, "console", scopes)
    finally:
        await engine.dispose()
    client = gateway.client
    page = await client.get("/console/login", params={"admin": 1})
    login = await client.post("/console/login", data={"csrf_token": CSRF.search(page.text).group(1),
                                                      "mode": "admin", "admin_token": secret})
    assert login.status_code == 303, login.text
    dashboard = await client.get("/console/admin")
    assert dashboard.status_code == 200, dashboard.text
    return client, CSRF.search(dashboard.text).group(1)


async def test_every_admin_page_renders(gateway: Gateway) -> None:
    client, _ = await _admin(gateway, ["admin:read", "admin:write"])
    for path in ("/console/admin", "/console/admin/accounts", f"/console/admin/accounts/{gateway.account_id}",
                 "/console/admin/plans", "/console/admin/plans/pro", "/console/admin/plans/pro/card", "/console/admin/models",
                 "/console/admin/usage", "/console/admin/audit"):
        page = await client.get(path)
        assert page.status_code == 200, (path, page.text[:300])


async def test_a_read_only_token_sees_but_cannot_write(gateway: Gateway) -> None:
    client, csrf = await _admin(gateway, ["admin:read"])
    for path, form in ((f"/console/admin/accounts/{gateway.account_id}/status", {"status": "suspended"}),
                       ("/console/admin/plans/pro", {"daily_limit": "5"}),
                       ("/console/admin/models/smollm2-135m-instruct", {"pinned": "true"})):
        refused = await client.post(path, data={"csrf_token": csrf, **form})
        assert refused.status_code == 403, (path, refused.text[:300])
        assert refused.json()["error"]["code"] == "insufficient_scope"
    assert await gateway.sql("SELECT status FROM accounts WHERE id = :a", a=gateway.account_id) == [("active",)]
