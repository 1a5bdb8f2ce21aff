"""The customer's journey in a real browser (Debian's Chromium, driven by Playwright) on the shared live
stack with the real engine: sign up, start the trial, create a key, call the API with the openai SDK
and that key, log out and in, chat in the playground (a counted request), rotate the key (the old one
works through its grace period and is refused after it). Screenshots of each main page are taken on
the way (into docs/screenshots with FLATFARE_TEST_SCREENSHOTS=1)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import pytest

from tests.conftest import Stack, eventually
from tests.console.conftest import PASSWORD, SECRET, clear_attempts, new_email, screenshot

pytestmark = pytest.mark.e2e


def _ask(stack: Stack, key: str) -> str:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=stack.model, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    return reply.choices[0].message.content or ""


def _requests_of_key(stack: Stack, key_id: int) -> int:
    return stack.sql("SELECT count(*) FROM requests WHERE api_key_id = :k", k=key_id)[0][0]


def test_sign_up_trial_key_api_call_logout_login_playground_rotate(stack: Stack, page, tmp_path: Path) -> None:  # noqa: ANN001
    base = stack.base_url
    email = new_email("journey")
    clear_attempts(stack.redis_url)
    page.on("dialog", lambda dialog: dialog.accept())  # the Rotate and Revoke confirmations

    page.goto(f"{base}/console/login")
    screenshot(page, "console-login", tmp_path)
    page.click("text=Create an account")
    page.fill("input[name=email]", email)
    page.fill("input[name=password]", PASSWORD)
    screenshot(page, "console-signup", tmp_path)
    page.click("button:has-text('Create account')")
    page.wait_for_url(f"{base}/console?done=welcome")
    account = stack.sql("SELECT a.id, a.plan FROM accounts a JOIN console_users u ON u.account_id = a.id "
                        "WHERE u.email = :e", e=email)
    assert account and account[0][1] == "free", account
    account_id = account[0][0]

    # The trial, once.
    page.click("button:has-text('Start 7-day trial')")
    page.wait_for_url(f"{base}/console?done=trial")
    assert page.locator(".stat-value").first.inner_text() == "Trial"
    assert page.locator("button:has-text('Start 7-day trial')").count() == 0
    plan, ends = stack.sql("SELECT plan, trial_ends_at FROM accounts WHERE id = :a", a=account_id)[0]
    assert plan == "trial" and ends is not None
    screenshot(page, "console-overview", tmp_path)

    # A key, shown once, that the openai SDK can use.
    page.click("nav >> text=API keys")
    page.fill("#create-key input[name=name]", "laptop")
    page.fill("#create-key input[name=daily_limit]", "100")
    page.click("#create-key button[type=submit]")
    secret = page.locator("#new-secret").inner_text().strip()
    assert SECRET.fullmatch(secret), secret
    screenshot(page, "console-keys", tmp_path)
    key_id, daily = stack.sql("SELECT id, daily_limit FROM api_keys WHERE prefix = :p", p=secret[:11])[0]
    assert daily == 100
    assert "Paris" in _ask(stack, secret)
    assert _requests_of_key(stack, key_id) == 1
    page.goto(f"{base}/console/keys")  # shown once: a fresh view of the page no longer has it
    assert page.locator("#new-secret").count() == 0 and secret not in page.content()

    # Log out, and back in.
    page.click("button:has-text('Log out')")
    page.wait_for_url(f"{base}/console/login")
    page.goto(f"{base}/console/keys")
    page.wait_for_url(f"{base}/console/login")
    page.fill("input[name=email]", email.upper())  # emails are case-insensitive
    page.fill("input[name=password]", PASSWORD)
    page.click("button:has-text('Log in')")
    page.wait_for_url(f"{base}/console")

    # The quick start names the plan's model; the playground's answer is a request like any other.
    page.click("nav >> text=Quick start")
    assert stack.model in page.locator("#snippet-curl").inner_text()
    screenshot(page, "console-quickstart", tmp_path)
    page.click("nav >> text=Playground")
    page.select_option("#pg-model", stack.model)
    page.fill("#pg-input", "What is the capital of France?")
    page.click("#pg-send")
    answer = page.locator(".msg-assistant").first
    eventually(lambda: (answer.inner_text(), page.locator("#pg-send").is_enabled()),
               lambda seen: bool(seen[0].strip()) and seen[1], "the playground's streamed answer", timeout_s=300)
    assert page.locator(".msg-error").count() == 0
    screenshot(page, "console-playground", tmp_path)
    playground = stack.sql("SELECT id FROM api_keys WHERE account_id = :a AND name = 'Console playground'",
                           a=account_id)
    assert len(playground) == 1, playground
    eventually(lambda: stack.sql("SELECT status, billable, plan FROM requests WHERE api_key_id = :k",
                                 k=playground[0][0]),
               lambda rows: rows == [("succeeded", True, "trial")], "the playground request in the ledger")
    page.click("nav >> text=API keys")
    assert page.locator("text=playground").count() >= 1  # the account sees the key the playground uses

    # Rotate: a new key with the same limits; the old one works until its grace period ends.
    row = page.locator(f"tr[data-key-id='{key_id}']")
    row.locator("button:has-text('Rotate')").click()
    rotated = page.locator("#new-secret").inner_text().strip()
    assert SECRET.fullmatch(rotated) and rotated != secret
    new_id, new_daily = stack.sql("SELECT id, daily_limit FROM api_keys WHERE prefix = :p", p=rotated[:11])[0]
    assert new_daily == 100
    (expires,) = stack.sql("SELECT expires_at FROM api_keys WHERE id = :i", i=key_id)[0]
    expires = datetime.fromisoformat(str(expires)).replace(tzinfo=UTC)
    grace = timedelta(seconds=int(stack.env.get("FLATFARE_CONSOLE_ROTATION_GRACE_S", 24 * 3600)))
    assert abs(expires - (datetime.now(UTC) + grace)) < timedelta(minutes=5), expires
    assert "Paris" in _ask(stack, rotated)
    assert "Paris" in _ask(stack, secret)  # within its grace period
    # The grace period ends (moved to now rather than waited for): the old key is refused.
    stack.sql("UPDATE api_keys SET expires_at = :t WHERE id = :i", t=datetime.now(UTC) - timedelta(seconds=1),
              i=key_id)

    def refused() -> bool:
        try:
            _ask(stack, secret)
        except openai.AuthenticationError as exc:
            return "expired" in str(exc)
        return False

    eventually(refused, bool, "the rotated key refused after its grace period")
    assert "Paris" in _ask(stack, rotated)
    page.goto(f"{base}/console/account")
    screenshot(page, "console-account", tmp_path)
    assert re.search(email, page.content())
