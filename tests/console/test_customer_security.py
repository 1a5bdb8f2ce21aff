"""The customer console's guarantees over plain HTTP, on the shared live stack: one customer never
reaches another's keys by id, every form needs the session's CSRF token, a login starts a new session
id, failed logins are limited, no message tells whether an email has an account, and every page
carries its security headers."""

from __future__ import annotations

import re

import httpx
import pytest
import redis as redis_sync

from flatfare.gateway.console import keyspace
from flatfare.gateway.console.sessions import hash_id
from tests.conftest import Stack
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts, new_email

pytestmark = pytest.mark.e2e


def _active(stack: Stack, key_id: int) -> bool:
    return stack.sql("SELECT revoked_at IS NULL AND expires_at IS NULL FROM api_keys WHERE id = :i", i=key_id)[0][0]


def test_a_customer_cannot_see_revoke_or_rotate_anothers_key(stack: Stack, customer: ConsoleClient) -> None:
    victim_id, victim_secret = customer.create_key("victim's")
    attacker = ConsoleClient(stack)
    try:
        attacker.signup(new_email("attacker"))
        page = attacker.get("/console/keys")
        assert page.status_code == 200
        assert victim_secret[:11] not in page.text and "victim&#39;s" not in page.text
        for action in ("revoke", "rotate"):
            tampered = attacker.post(f"/console/keys/{victim_id}/{action}")
            assert tampered.status_code == 404, tampered.text
            assert tampered.json()["error"]["code"] == "key_not_found"
        assert _active(stack, victim_id), "another customer's request changed the key"
        # The owner can.
        assert customer.post(f"/console/keys/{victim_id}/revoke").status_code == 303
        assert not _active(stack, victim_id)
    finally:
        attacker.close()


def test_every_form_needs_the_sessions_csrf_token(stack: Stack, customer: ConsoleClient) -> None:
    key_id, _ = customer.create_key()
    forms = ["/console/keys", f"/console/keys/{key_id}/revoke", f"/console/keys/{key_id}/rotate", "/console/trial",
             "/console/account/password", "/console/logout", "/console/login", "/console/signup", "/console/reset"]
    for path in forms:
        for token in (None, "x" * 43):
            data = {"name": "csrf", "email": "someone@example.com", "password": PASSWORD}
            if token is not None:
                data["csrf_token"] = token
            refused = customer.post(path, data, csrf=False)
            assert refused.status_code == 403, (path, token, refused.text)
            assert refused.json()["error"]["code"] == "csrf_failed"
    chat = customer.http.post("/console/playground/chat", json={"model": stack.model,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 403 and chat.json()["error"]["code"] == "csrf_failed"
    assert _active(stack, key_id), "a refused form changed something"
    # Another session's token is no better than none.
    other = ConsoleClient(stack)
    try:
        other.get("/console/login")
        stolen = customer.post(f"/console/keys/{key_id}/revoke", {"csrf_token": other.csrf}, csrf=False)
        assert stolen.status_code == 403
    finally:
        other.close()
    assert customer.post(f"/console/keys/{key_id}/revoke").status_code == 303  # with its own token


def test_login_starts_a_new_session_id_and_the_old_one_is_worth_nothing(stack: Stack) -> None:
    email = new_email()
    owner = ConsoleClient(stack)
    owner.signup(email)
    owner.close()
    # A session id planted before login (fixation): the victim's browser logs in with it.
    client = ConsoleClient(stack)
    try:
        client.get("/console/login")
        planted = client.session_cookie
        assert planted
        assert client.login(email).status_code == 303
        assert client.session_cookie and client.session_cookie != planted
        attacker = httpx.Client(base_url=stack.base_url, cookies={"ff_console": planted})
        try:
            assert attacker.get("/console").status_code == 303  # to the login page: not logged in
        finally:
            attacker.close()
        assert client.get("/console").status_code == 200
        # Logging out ends the session in Redis, not only in the browser.
        live = client.session_cookie
        assert client.post("/console/logout").status_code == 303
        replay = httpx.Client(base_url=stack.base_url, cookies={"ff_console": live})
        try:
            assert replay.get("/console").status_code == 303
        finally:
            replay.close()
    finally:
        client.close()


def test_sessions_are_stored_by_hash_with_an_expiry(stack: Stack, customer: ConsoleClient) -> None:
    cookie = customer.session_cookie
    redis = redis_sync.Redis.from_url(stack.redis_url)
    try:
        assert not redis.exists(keyspace.console_session_key(cookie)), "the raw session id is a Redis key"
        key = keyspace.console_session_key(hash_id(cookie))
        assert redis.hget(key, "email").decode() == customer.email  # type: ignore[attr-defined]
        assert 0 < redis.ttl(key) <= 8 * 3600
    finally:
        redis.close()


def test_console_pages_carry_the_security_headers(stack: Stack, customer: ConsoleClient) -> None:
    for path in ("/console", "/console/keys", "/console/quickstart", "/console/playground", "/console/account",
                 "/console/login", "/console/signup"):
        response = customer.http.get(path)
        assert response.status_code in (200, 303), path
        csp = response.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["frame-ancestors"] == "'none'", path
        assert directives["script-src"] == "'self'" and "unsafe" not in csp, path
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert response.headers["cache-control"] == "no-store"
    # The API keeps its own headers: the CSP is the console's.
    assert "content-security-policy" not in httpx.get(f"{stack.base_url}/healthz").headers
    cookie = httpx.get(f"{stack.base_url}/console/login").headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "path=/" in cookie
    # Local mode (the test stacks') leaves Secure off; see test_sessions.py for the https cookie.
    assert "secure" not in cookie


def test_no_message_tells_whether_an_email_has_an_account(stack: Stack, customer: ConsoleClient) -> None:
    stranger = ConsoleClient(stack)
    try:
        clear_attempts(stack.redis_url)
        stranger.get("/console/login")
        known = stranger.post("/console/login", {"email": customer.email, "password": "wrong password!"})  # type: ignore[attr-defined]
        unknown = stranger.post("/console/login", {"email": new_email("nobody"), "password": "wrong password!"})
        assert known.status_code == unknown.status_code == 401
        assert _alert(known.text) == _alert(unknown.text)
        stranger.get("/console/reset")
        reset_known = stranger.post("/console/reset", {"email": customer.email})  # type: ignore[attr-defined]
        reset_unknown = stranger.post("/console/reset", {"email": new_email("nobody")})
        assert reset_known.status_code == reset_unknown.status_code == 200
        assert _alert(reset_known.text) == _alert(reset_unknown.text)
    finally:
        stranger.close()
        clear_attempts(stack.redis_url)


def _alert(html: str) -> str:
    found = re.findall(r'class="alert[^"]*"[^>]*>([^<]+)<', html)
    assert found, "no message on the page"
    return found[0]


def test_failed_logins_are_limited_per_account_and_per_address(stack: Stack, customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    attempts = int(stack.env.get("FLATFARE_CONSOLE_LOGIN_ATTEMPTS", "10"))
    client = ConsoleClient(stack)
    try:
        clear_attempts(stack.redis_url)
        client.get("/console/login")
        for _ in range(attempts):
            assert client.post("/console/login", {"email": email, "password": "not the password"}).status_code == 401
        # Past the limit even the right password is refused: guessing stops here.
        limited = client.post("/console/login", {"email": email, "password": PASSWORD})
        assert limited.status_code == 429, limited.text
        # The address is limited too: another account's login from it is refused as well.
        other = client.post("/console/login", {"email": new_email("other"), "password": PASSWORD})
        assert other.status_code == 429
        clear_attempts(stack.redis_url)
        assert client.post("/console/login", {"email": email, "password": PASSWORD}).status_code == 303
    finally:
        client.close()
        clear_attempts(stack.redis_url)


def test_oversized_and_malformed_forms_are_refused_with_an_error_body(stack: Stack, customer: ConsoleClient) -> None:
    big = customer.post("/console/keys", {"name": "x" * (100 * 1024)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    fields = customer.post("/console/keys", {f"f{i}": "1" for i in range(200)})
    assert fields.status_code == 400 and fields.json()["error"]["code"] == "invalid_form"
    as_json = customer.http.post("/console/keys", json={"name": "x", "csrf_token": customer.csrf})
    assert as_json.status_code == 415 and as_json.json()["error"]["type"]
    chat = customer.http.post("/console/playground/chat", headers={"X-CSRF-Token": customer.csrf},
                              json={"model": stack.model, "messages": [{"role": "user", "content": "x" * 40_000}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "invalid_request"
    bad_limit = customer.post("/console/keys", {"name": "x", "daily_limit": "0"})
    assert bad_limit.status_code == 400 and "daily_limit" in bad_limit.text
