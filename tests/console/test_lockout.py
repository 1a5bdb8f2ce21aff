"""Failed console attempts lock an email only from the address that failed (flatfare.gateway.console.ratelimit),
and its owner is told by email (flatfare.gateway.console.lockout; without SMTP, in local mode, the
gateway's log): a stranger guessing at someone's email cannot lock them out. The password-change form
counts a wrong current password as the login page counts a wrong password. On the shared live stack,
the stranger from another loopback address (127.0.0.2), the owner in a real browser."""

from __future__ import annotations

import httpx
import pytest

from flatfare.gateway.console.lockout import SUBJECT
from flatfare.gateway.console.mail import LOG_MARK
from tests.conftest import Stack, eventually
from tests.console.conftest import PASSWORD, ConsoleClient, clear_attempts, csrf_of

pytestmark = pytest.mark.e2e


def _notices(stack: Stack, email: str) -> list[str]:
    log = (stack.logs / "gateway.log").read_text(errors="replace")
    return [line for line in log.splitlines() if LOG_MARK in line and email in line and SUBJECT in line]


def test_a_stranger_cannot_lock_the_owner_out_and_the_owner_is_told(stack: Stack, customer: ConsoleClient,
                                                                    page) -> None:  # noqa: ANN001
    email = customer.email  # type: ignore[attr-defined]
    attempts = int(stack.env.get("FLATFARE_CONSOLE_LOGIN_ATTEMPTS", "10"))
    clear_attempts(stack.redis_url)
    stranger = httpx.Client(base_url=stack.base_url, timeout=60,
                            transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    try:
        form = csrf_of(stranger.get("/console/login").text)
        statuses = [stranger.post("/console/login", data={"csrf_token": form, "email": email,
                                                           "password": "a wrong guess"}).status_code
                    for _ in range(attempts)]
        assert statuses == [401] * attempts
        locked = stranger.post("/console/login", data={"csrf_token": form, "email": email, "password": PASSWORD})
        assert locked.status_code == 429, "past the limit the stranger's address is refused, right password or not"

        # The owner, from their own address, logs in as usual.
        page.goto(f"{stack.base_url}/console/login")
        page.fill("input[name=email]", email)
        page.fill("input[name=password]", PASSWORD)
        page.click("button:has-text('Log in')")
        page.wait_for_url(f"{stack.base_url}/console")

        # ...and is told, once, from which address their login was locked.
        notices = eventually(lambda: _notices(stack, email), bool, "the lockout notice in the gateway's log")
        assert len(notices) == 1 and "127.0.0.2" in notices[0] and "wrong passwords on the login page" in notices[0]
    finally:
        stranger.close()
        clear_attempts(stack.redis_url)


def test_the_password_form_is_limited_like_the_login(stack: Stack, customer: ConsoleClient, page) -> None:  # noqa: ANN001
    """A session in someone else's hands must not become a way to guess the password."""
    email = customer.email  # type: ignore[attr-defined]
    attempts = int(stack.env.get("FLATFARE_CONSOLE_LOGIN_ATTEMPTS", "10"))
    clear_attempts(stack.redis_url)
    try:
        customer.get("/console/account")
        for _ in range(attempts):
            wrong = customer.post("/console/account/password", {"current": "a wrong guess",
                                                                "password": "another long password"})
            assert wrong.status_code == 400, wrong.text
        # In the browser, with the same session: even the right current password is refused now.
        page.context.add_cookies([{"name": "ff_console", "value": customer.session_cookie, "url": stack.base_url}])
        page.goto(f"{stack.base_url}/console/account")
        page.fill("input[name=current]", PASSWORD)
        page.fill("input[name=password]", "another long password")
        with page.expect_response(f"{stack.base_url}/console/account/password") as answered:
            page.locator("form[action='/console/account/password'] button[type=submit]").click()
        assert answered.value.status == 429
        assert "Too many failed attempts" in page.locator("[role=alert]").inner_text()
        assert stack.sql("SELECT count(*) FROM console_users WHERE email = :e", e=email) == [(1,)]
        notices = eventually(lambda: _notices(stack, email), bool, "the lockout notice in the gateway's log")
        assert len(notices) == 1 and "password-change form" in notices[0]
    finally:
        clear_attempts(stack.redis_url)
