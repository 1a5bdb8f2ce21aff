"""The operator's sign-up switches, on a gateway of their own (no worker: none is needed): an
invite-only console refuses sign-up, its users come from ``flatfare console-users create``; with email
confirmation on, a sign-up always answers "check your email", and only the emailed link (read from the
gateway's log, where it goes without SMTP) lets the new user in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from flatfare.gateway.console.mail import LOG_MARK
from flatfare.redis_local import LocalRedis, free_port
from flatfare.storage.db import migrate
from tests.conftest import eventually, stop_process
from tests.console.conftest import PASSWORD, ConsoleClient, new_email
from tests.conftest import Stack


class Gateway:
    def __init__(self, base_url: str, log: Path, env: dict[str, str]) -> None:
        self.base_url, self.log, self.env = base_url, log, env

    def cli(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flatfare", *args], env=self.env, input=stdin,
                              capture_output=True, text=True, timeout=120, check=False)


@contextmanager
def _gateway(data: Path, **settings: str) -> Iterator[Gateway]:
    redis = LocalRedis(data / "redis", persist=False).start()
    database_url = f"sqlite:///{data / 'flatfare.db'}"
    migrate(database_url)
    env = {**os.environ, "FLATFARE_DATA_DIR": str(data), "FLATFARE_DATABASE_URL": database_url,
           "FLATFARE_REDIS_URL": redis.url, "FLATFARE_LOCAL_MODE": "1", **settings}
    port = free_port()
    log = data / "gateway.log"
    proc = subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", str(port)], env=env, cwd=data,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not answer /healthz"
            time.sleep(0.3)
        yield Gateway(base_url, log, env)
    finally:
        stop_process(proc)
        redis.stop()


@pytest.fixture(scope="module")
def invite_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with _gateway(tmp_path_factory.mktemp("invite-only"), FLATFARE_CONSOLE_SIGNUP="false") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def confirming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with _gateway(tmp_path_factory.mktemp("confirming"),
                  FLATFARE_CONSOLE_REQUIRE_EMAIL_VERIFICATION="true") as gateway:
        yield gateway


def _client(gateway: Gateway) -> ConsoleClient:
    client = ConsoleClient.__new__(ConsoleClient)
    client.http = httpx.Client(base_url=gateway.base_url, timeout=60)
    client.csrf = ""
    return client


def _links(gateway: Gateway, email: str, kind: str) -> list[str]:
    return [re.search(rf"/console/{kind}/[A-Za-z0-9_-]+", line).group(0)
            for line in gateway.log.read_text(errors="replace").splitlines()
            if LOG_MARK in line and email in line and f"/console/{kind}/" in line]


def _owner_notes(gateway: Gateway, email: str) -> list[str]:
    return [line for line in gateway.log.read_text(errors="replace").splitlines()
            if LOG_MARK in line and email in line and "already has an account" in line]


def test_invite_only_refuses_sign_up_and_users_come_from_the_cli(invite_only: Gateway) -> None:
    gateway = invite_only
    client = _client(gateway)
    try:
        page = client.get("/console/signup")
        assert "by invitation" in page.text
        assert "Create an account" not in client.get("/console/login").text  # (and its form's token)
        refused = client.post("/console/signup", {"email": new_email(), "password": PASSWORD})
        assert refused.status_code == 403 and "by invitation" in refused.text
        email = new_email("invited")
        made = gateway.cli("console-users", "create", email, "--account", "acme", "--plan", "pro",
                           "--password-stdin", stdin=PASSWORD + "\n")
        assert made.returncode == 0, made.stderr
        assert client.login(email.upper()).status_code == 303
        assert "acme" in client.get("/console").text
        admin = new_email("boss")
        assert gateway.cli("console-users", "create", admin, "--admin", "--password-stdin",
                           stdin=PASSWORD + "\n").returncode == 0
        boss = _client(gateway)
        try:
            assert boss.login(admin).headers["location"] == "/console/admin"
        finally:
            boss.http.close()
    finally:
        client.http.close()


def test_with_confirmation_on_sign_up_says_the_same_and_only_the_link_lets_in(confirming: Gateway) -> None:
    gateway = confirming
    email = new_email()
    first, again, stranger = _client(gateway), _client(gateway), _client(gateway)
    try:
        first.get("/console/signup")
        new = first.post("/console/signup", {"email": email, "password": PASSWORD})
        again.get("/console/signup")
        taken = again.post("/console/signup", {"email": email.upper(), "password": "another long password"})
        assert new.status_code == taken.status_code == 200
        assert _alert(new.text) == _alert(taken.text) and "Check your email" in _alert(new.text)
        assert first.http.get("/console").status_code == 303  # nobody is logged in by a sign-up
        unconfirmed = stranger.login(email)
        assert unconfirmed.status_code == 403 and "Confirm your email" in unconfirmed.text
        # The address is not confirmed yet: the second sign-up sends a fresh confirmation link (the
        # first may have been lost), not the "already has an account" note.
        links = eventually(lambda: _links(gateway, email, "verify"), lambda found: len(found) >= 2,
                           f"two verify links for {email} in the gateway's log")
        assert links[0] != links[1] and not _owner_notes(gateway, email)
        link = links[-1]
        assert stranger.http.get(link).status_code == 303
        assert stranger.http.get(link).status_code == 400  # once
        assert stranger.login(email).status_code == 303
        assert stranger.http.get("/console").status_code == 200
        # Once confirmed, the owner of the taken address is told by email, with no link that changes anything.
        again.get("/console/signup")
        assert again.post("/console/signup", {"email": email, "password": "another long password"}).status_code == 200
        eventually(lambda: _owner_notes(gateway, email), bool, f"the owner's note for {email}")
        assert len(_links(gateway, email, "verify")) == 2
    finally:
        for client in (first, again, stranger):
            client.http.close()


def _alert(html: str) -> str:
    found = re.findall(r'class="alert[^"]*"[^>]*>([^<]+)<', html)
    assert found, "no message on the page"
    return found[0]


@pytest.mark.e2e
def test_a_reset_link_marks_the_email_confirmed(stack: Stack, customer: ConsoleClient) -> None:
    from tests.console.test_customer_account import NEW_PASSWORD, _reset_link

    email = customer.email  # type: ignore[attr-defined]
    stack.sql("UPDATE console_users SET email_verified_at = NULL WHERE email = :e", e=email)
    visitor = ConsoleClient(stack)
    try:
        visitor.get("/console/reset")
        assert visitor.post("/console/reset", {"email": email}).status_code == 200
        path = "/console/reset/" + _reset_link(stack, email).rsplit("/", 1)[1]
        visitor.get(path)
        assert visitor.post(path, {"password": NEW_PASSWORD}).status_code == 303
        assert stack.sql("SELECT email_verified_at FROM console_users WHERE email = :e", e=email)[0][0] is not None
    finally:
        visitor.close()
