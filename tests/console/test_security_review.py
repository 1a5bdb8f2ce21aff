"""Defects a security review found in the console, each pinned: sessions that outlive a password
change, one-time links in the log outside local mode, the admin-without-account redirect loop."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from argon2 import PasswordHasher

from flatfare import contract
from flatfare.gateway.console.mail import LOG_MARK, Mailer
from flatfare.gateway.console.sessions import hash_id
from flatfare.gateway.settings import GatewaySettings
from tests.conftest import Stack, eventually, free_port, stop_process
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts, csrf_of, new_email

NEW_PASSWORD = "a different long passphrase"


def _redis(stack: Stack) -> redis_sync.Redis:
    return redis_sync.Redis.from_url(stack.redis_url)


@pytest.mark.e2e
def test_a_session_that_outlived_the_users_index_still_ends_on_a_password_change(stack: Stack,
                                                                                 customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    attacker = ConsoleClient(stack)
    try:
        assert attacker.login(email).status_code == 303
        user_id = stack.sql("SELECT id FROM console_users WHERE email = :e", e=email)[0][0]
        client = _redis(stack)
        try:  # the per-user index expired while the attacker's session kept being renewed
            client.delete(contract.console_user_sessions_key(user_id))
        finally:
            client.close()
        customer.get("/console/account")
        changed = customer.post("/console/account/password", {"current": PASSWORD, "password": NEW_PASSWORD})
        assert changed.status_code == 303
        assert customer.http.get("/console").status_code == 200  # the one who changed it stays in
        assert attacker.http.get("/console").status_code == 303  # the session from before is refused
        assert attacker.http.get("/console/keys").status_code == 303
    finally:
        attacker.close()
        clear_attempts(stack.redis_url)


@pytest.mark.e2e
def test_renewing_a_session_renews_the_users_index_too(stack: Stack, customer: ConsoleClient) -> None:
    user_id = stack.sql("SELECT id FROM console_users WHERE email = :e",
                        e=customer.email)[0][0]  # type: ignore[attr-defined]
    index = contract.console_user_sessions_key(user_id)
    client = _redis(stack)
    try:  # both near their end: the next request renews the session, and must renew the index with it
        client.expire(contract.console_session_key(hash_id(customer.session_cookie or "")), 30)
        client.expire(index, 30)
        assert customer.http.get("/console").status_code == 200
        assert client.ttl(index) > 30
    finally:
        client.close()


async def test_without_smtp_outside_local_mode_no_link_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    link = "https://console.example.com/console/reset/abcdefghijklmnop"
    caplog.set_level(logging.WARNING, logger="flatfare.console")
    await Mailer(GatewaySettings.model_construct(smtp_host="", local_mode=False)).send(
        "Victim@Example.com", "Reset your Flatfare password", f"Open this link: {link}")
    text = caplog.text
    assert "SMTP not configured" in text
    assert link not in text and "abcdefghijklmnop" not in text
    assert "victim@example.com" not in text.lower() and LOG_MARK not in text
    caplog.clear()
    await Mailer(GatewaySettings.model_construct(smtp_host="", local_mode=True)).send(
        "dev@example.com", "Reset your Flatfare password", f"Open this link: {link}")
    assert link in caplog.text and LOG_MARK in caplog.text  # local mode: the operator opens it from the log


@pytest.mark.e2e
def test_an_admin_user_without_an_account_is_sent_to_the_admin_pages(stack: Stack) -> None:
    email = new_email("admin")
    stack.sql("INSERT INTO console_users (email, password_hash, account_id, is_admin, email_verified_at) "
              "VALUES (:e, :h, NULL, TRUE, CURRENT_TIMESTAMP)", e=email, h=PasswordHasher().hash(PASSWORD))
    admin = ConsoleClient(stack)
    try:
        clear_attempts(stack.redis_url)
        admin.get("/console/login")
        login = admin.post("/console/login", {"email": email, "password": PASSWORD})
        assert login.status_code == 303 and login.headers["location"] == "/console/admin"
        again = admin.http.get("/console/login")  # already logged in: straight to the admin pages
        assert again.status_code == 303 and again.headers["location"] == "/console/admin"
        page = admin.http.get("/console/admin")
        assert page.status_code == 200
        assert 'class="brand" href="/console/admin"' in page.text
    finally:
        admin.close()
        clear_attempts(stack.redis_url)


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_behind_a_trusted_proxy_each_client_has_its_own_login_counter(stack: Stack, tmp_path: Path,
                                                                       server: str) -> None:
    """A gateway trusting 127.0.0.0/8 (FLATFARE_FORWARDED_ALLOW_IPS), reached from 127.0.0.2 as from a
    proxy: the failed logins of one forwarded client do not lock out another."""
    port = free_port()
    env = {**stack.env, "FLATFARE_FORWARDED_ALLOW_IPS": "127.0.0.0/8", "FLATFARE_CONSOLE_LOGIN_ATTEMPTS": "3",
           "FLATFARE_SERVER": server}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", str(port)], env=env,
                               cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def login(client_ip: str) -> int:
        headers = {"X-Forwarded-For": client_ip}
        fresh = httpx.Client(base_url=f"http://127.0.0.1:{port}", transport=httpx.HTTPTransport(
            local_address="127.0.0.2"), timeout=60, headers=headers)
        try:
            page = fresh.get("/console/login")
            return fresh.post("/console/login", data={"csrf_token": csrf_of(page.text), "email": new_email(),
                                                      "password": "not the password at all"}).status_code
        finally:
            fresh.close()

    try:
        def up() -> int:
            try:
                return http.get("/console/login").status_code
            except httpx.TransportError:
                return 0

        eventually(up, lambda status: status == 200, "the second gateway answering", timeout_s=120)
        clear_attempts(stack.redis_url)
        statuses = [login("203.0.113.1") for _ in range(4)]
        assert statuses[-1] == 429, statuses  # that client is locked out...
        assert login("203.0.113.2") == 401  # ...and another one, through the same proxy, is not
    finally:
        http.close()
        stop_process(gateway)
        log.close()
        clear_attempts(stack.redis_url)
