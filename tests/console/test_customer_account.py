"""Password reset by emailed link (read from the gateway's log, where it goes without SMTP), password
change, and the session cookie outside local mode."""

from __future__ import annotations

import re

import pytest
from starlette.responses import Response

from flatfare.gateway.console.mail import LOG_MARK
from flatfare.gateway.console.sessions import ConsoleSessions
from tests.conftest import Stack, eventually
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts

NEW_PASSWORD = "a different long passphrase"


def _reset_link(stack: Stack, email: str) -> str:
    def links() -> list[str]:
        log = (stack.logs / "gateway.log").read_text(errors="replace")
        return [re.search(r"https?://\S+/console/reset/[A-Za-z0-9_-]+", line).group(0)
                for line in log.splitlines() if LOG_MARK in line and email in line]

    return eventually(links, bool, f"the reset link for {email} in the gateway's log")[-1]


@pytest.mark.e2e
def test_a_reset_link_sets_a_new_password_once_and_ends_every_session(stack: Stack, customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    visitor = ConsoleClient(stack)
    try:
        clear_attempts(stack.redis_url)
        visitor.get("/console/reset")
        assert visitor.post("/console/reset", {"email": email.upper()}).status_code == 200
        path = "/console/reset/" + _reset_link(stack, email).rsplit("/", 1)[1]
        assert visitor.get(path).status_code == 200
        short = visitor.post(path, {"password": "short"})
        assert short.status_code == 400 and "at least" in short.text
        assert visitor.post(path, {"password": NEW_PASSWORD}).status_code == 303
        # Once only; and the customer's session, opened with the old password, is over.
        assert visitor.get(path).status_code == 400
        assert customer.http.get("/console").status_code == 303
        assert visitor.login(email, PASSWORD).status_code == 401
        assert visitor.login(email, NEW_PASSWORD).status_code == 303
    finally:
        visitor.close()
        clear_attempts(stack.redis_url)


@pytest.mark.e2e
def test_a_password_change_needs_the_current_one_and_logs_out_other_sessions(stack: Stack,
                                                                                customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    other = ConsoleClient(stack)
    try:
        assert other.login(email).status_code == 303
        customer.get("/console/account")
        wrong = customer.post("/console/account/password", {"current": "not it at all", "password": NEW_PASSWORD})
        assert wrong.status_code == 400
        changed = customer.post("/console/account/password", {"current": PASSWORD, "password": NEW_PASSWORD})
        assert changed.status_code == 303
        assert customer.http.get("/console").status_code == 200  # this session stays
        assert other.http.get("/console").status_code == 303  # the other one ended
        assert other.login(email, NEW_PASSWORD).status_code == 303
    finally:
        other.close()


async def test_outside_local_mode_the_cookie_is_secure_and_host_only(redis) -> None:  # noqa: ANN001
    response = Response()
    await ConsoleSessions(redis, idle_s=3600, secure=True).start(response, user_id=1, account_id=1, email="a@b.c")
    cookie = response.headers["set-cookie"]
    assert cookie.startswith("__Host-ff_console=")
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"secure", "httponly", "samesite=lax", "path=/"} <= flags
    assert not any(flag.startswith("domain") for flag in flags)
