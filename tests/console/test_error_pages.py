"""A browser refused on a console page gets a page in the console's look with a way back, never raw
JSON (flatfare.gateway.console.error_pages), in a real browser on the shared live stack: a mistyped
address (404), ``/console/logout`` typed in (405), a stale tab's form after logging out (401), a stale
CSRF token (403), a form too large (413), too many wrong logins (429). The API keeps OpenAI's JSON for
the same refusals. (A failure of ours, 500, is checked in one process: tests/console/test_pages.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack
from tests.console.conftest import ConsoleClient, clear_attempts, screenshot

pytestmark = pytest.mark.e2e


def _shows_page(page, status: int, way_back: str) -> None:  # noqa: ANN001 - a Playwright Page
    """The console's error page for ``status``, with a link to ``way_back`` that works."""
    shown = page.locator("#error-page")
    assert shown.count() == 1, page.content()[:500]
    assert shown.get_attribute("data-status") == str(status)
    assert page.locator("link[href='/console/static/console.css']").count() == 1  # styled as the console
    link = page.locator(f"#error-page a[href='{way_back}']")
    assert link.count() == 1
    assert '{"error"' not in page.content()


def test_refusals_in_the_browser_are_console_pages_with_a_way_back(stack: Stack, customer: ConsoleClient,
                                                                   page, tmp_path: Path) -> None:  # noqa: ANN001
    base = stack.base_url
    page.context.add_cookies([{"name": "ff_console", "value": customer.session_cookie, "url": base}])
    key_id, _ = customer.create_key("kept")

    answer = page.goto(f"{base}/console/kyes")
    assert answer.status == 404
    _shows_page(page, 404, "/console")
    screenshot(page, "console-error-404", tmp_path)
    page.click("#error-page a[href='/console']")
    page.wait_for_url(f"{base}/console")

    answer = page.goto(f"{base}/console/logout")
    assert answer.status == 405
    _shows_page(page, 405, "/console")

    # A stale CSRF token (the form kept from another session's page): 403.
    page.goto(f"{base}/console/keys")
    page.locator("#create-key input[name=csrf_token]").evaluate("e => e.value = 'x'.repeat(43)")
    page.fill("#create-key input[name=name]", "stale")
    with page.expect_response(f"{base}/console/keys") as refused:
        page.click("#create-key button[type=submit]")
    assert refused.value.status == 403
    _shows_page(page, 403, "/console")
    assert "reload the page" in page.locator("#error-page").inner_text()

    # A form too large (a field past the 64 KiB a console form may carry): 413.
    page.goto(f"{base}/console/keys")
    page.locator("#create-key input[name=name]").evaluate(
        "e => { e.removeAttribute('maxlength'); e.value = 'x'.repeat(100 * 1024); }")
    with page.expect_response(f"{base}/console/keys") as refused:
        page.click("#create-key button[type=submit]")
    assert refused.value.status == 413
    _shows_page(page, 413, "/console")

    # A tab left open after logging out elsewhere: its form answers 401 with a way to log in again.
    page.goto(f"{base}/console/keys")
    assert customer.post("/console/logout").status_code == 303
    page.on("dialog", lambda dialog: dialog.accept())
    with page.expect_response(f"{base}/console/keys/{key_id}/revoke") as refused:
        page.locator(f"tr[data-key-id='{key_id}'] button:has-text('Revoke')").click()
    assert refused.value.status == 401
    _shows_page(page, 401, "/console/login")
    assert stack.sql("SELECT revoked_at FROM api_keys WHERE id = :k", k=key_id) == [(None,)]

    # Too many wrong passwords: the login page itself says so (429), in the console's look.
    clear_attempts(stack.redis_url)
    try:
        attempts = int(stack.env.get("FLATFARE_CONSOLE_LOGIN_ATTEMPTS", "10"))
        for _ in range(attempts + 1):
            page.goto(f"{base}/console/login")
            page.fill("input[name=email]", customer.email)  # type: ignore[attr-defined]
            page.fill("input[name=password]", "not the password")
            with page.expect_response(f"{base}/console/login") as answered:
                page.click("button:has-text('Log in')")
        assert answered.value.status == 429
        assert "Too many failed attempts" in page.locator("[role=alert]").inner_text()
        assert page.locator("a[href='/console/login']").count() >= 1
    finally:
        clear_attempts(stack.redis_url)


def test_the_api_keeps_openais_json_error_bodies(stack: Stack) -> None:
    """Asked for HTML (as a browser asks), the API's refusals stay OpenAI's JSON."""
    html = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    for method, path in (("GET", "/v1/nope"), ("GET", "/v1/models"), ("DELETE", "/v1/models"),
                         ("GET", "/admin/v1/accounts"), ("POST", "/v1/chat/completions")):
        answer = httpx.request(method, f"{stack.base_url}{path}", headers=html, timeout=30)
        assert answer.status_code >= 400 and answer.headers["content-type"].startswith("application/json"), \
            (path, answer.status_code, answer.text[:200])
        assert answer.json()["error"]["message"], path
    # A console request that does not ask for HTML (htmx, a script) keeps JSON too.
    answer = httpx.post(f"{stack.base_url}/console/keys/1/revoke", headers={"HX-Request": "true", **html})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "login_required"
    assert httpx.get(f"{stack.base_url}/console/nope").json()["error"]["code"] == "not_found"
