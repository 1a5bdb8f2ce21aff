"""The customer's key routes (flatfare.gateway.console.keys) in one gateway process (tests/gateway/rig.py):
every write takes the session's CSRF form, and acts on the customer's own keys only. The same pages in
a real browser: tests/console/test_customer_journey.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.console.conftest import CSRF, PASSWORD, SECRET, new_email
from tests.gateway.rig import Gateway, in_process_gateway
from tests.conftest import Stack
from tests.console.conftest import ConsoleClient


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path, local_mode=True) as gateway:
        yield gateway


async def _page(client: httpx.AsyncClient, path: str) -> str:
    """The page's CSRF token."""
    response = await client.get(path)
    assert response.status_code == 200, response.text
    match = CSRF.search(response.text)
    assert match, f"no CSRF token on {path}"
    return match.group(1)


async def _customer_with_a_key(client: httpx.AsyncClient) -> tuple[int, str, str]:
    """Signed up, with one key made on the keys page: (key id, its prefix, the session's CSRF token)."""
    csrf = await _page(client, "/console/signup")
    signed_up = await client.post("/console/signup", data={"email": new_email(), "password": PASSWORD,
                                                           "csrf_token": csrf})
    assert signed_up.status_code == 303, signed_up.text
    csrf = await _page(client, "/console/keys")
    created = await client.post("/console/keys", data={"name": "mine", "csrf_token": csrf})
    assert created.status_code == 201, created.text
    secret = SECRET.search(created.text)
    key_id = re.search(r'/console/keys/(\d+)/revoke', created.text)
    assert secret and key_id, "the new key is not on the page"
    return int(key_id.group(1)), secret.group(0)[:11], csrf


async def test_revoking_a_key_needs_the_session_s_csrf_form(gateway: Gateway) -> None:
    client = gateway.client
    key_id, prefix, csrf = await _customer_with_a_key(client)
    for form in ({"confirm": "yes"}, {"csrf_token": "forged"}):
        refused = await client.post(f"/console/keys/{key_id}/revoke", data=form)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "csrf_failed"
    assert await gateway.sql("SELECT revoked_at FROM api_keys WHERE id = :k", k=key_id) == [(None,)]
    revoked = await client.post(f"/console/keys/{key_id}/revoke", data={"csrf_token": csrf})
    assert revoked.status_code == 303, revoked.text
    [(revoked_at,)] = await gateway.sql("SELECT revoked_at FROM api_keys WHERE prefix = :p", p=prefix)
    assert revoked_at is not None


async def test_another_account_s_key_is_not_found(gateway: Gateway) -> None:
    client = gateway.client
    _, _, csrf = await _customer_with_a_key(client)
    [(theirs,)] = await gateway.sql("SELECT id FROM api_keys WHERE account_id = :a", a=gateway.account_id)
    refused = await client.post(f"/console/keys/{theirs}/revoke", data={"csrf_token": csrf})
    assert refused.status_code == 404, refused.text
    assert await gateway.sql("SELECT revoked_at FROM api_keys WHERE id = :k", k=theirs) == [(None,)]


@pytest.mark.e2e
def test_rotating_a_key_keeps_its_expiry(stack: Stack, customer: ConsoleClient) -> None:
    key_id, _ = customer.create_key("expiring")
    stack.sql("UPDATE api_keys SET expires_at = '2099-01-02 03:04:05' WHERE id = :k", k=key_id)
    customer.get("/console/keys")
    rotated = customer.post(f"/console/keys/{key_id}/rotate")
    assert rotated.status_code == 201, rotated.text
    (expiry,) = stack.sql("SELECT expires_at FROM api_keys WHERE account_id = (SELECT account_id FROM api_keys "
                          "WHERE id = :k) AND id > :k", k=key_id)[0]
    assert expiry is not None and str(expiry).startswith("2099-01-02 03:04:05")


NONCE = re.compile(r'name="form_nonce" value="([^"]+)"')


@pytest.mark.e2e
def test_a_key_form_sent_twice_issues_one_key(stack: Stack, customer: ConsoleClient) -> None:
    """A browser re-posts the create (or rotate) form on refresh, and a double click sends it twice: the
    form's one-time nonce makes the second send a redirect that issues nothing."""
    def keys() -> int:
        return stack.sql("SELECT count(*) FROM api_keys WHERE account_id = (SELECT account_id FROM api_keys "
                         "WHERE id = :k)", k=key_id)[0][0]

    key_id, _ = customer.create_key("first")
    page = customer.get("/console/keys").text
    nonce = NONCE.search(page).group(1)
    before = keys()
    made = customer.post("/console/keys", {"name": "twice", "form_nonce": nonce})
    assert made.status_code == 201 and keys() == before + 1
    again = customer.post("/console/keys", {"name": "twice", "form_nonce": nonce})
    assert again.status_code == 303 and again.headers["location"] == "/console/keys?resubmitted=1"
    assert keys() == before + 1
    assert "No second key was made" in customer.get(again.headers["location"]).text
    nonce = NONCE.search(customer.get("/console/keys").text).group(1)
    assert customer.post(f"/console/keys/{key_id}/rotate", {"form_nonce": nonce}).status_code == 201
    assert customer.post(f"/console/keys/{key_id}/rotate", {"form_nonce": nonce}).status_code == 303
    assert keys() == before + 2
