"""What a paying customer meets on the console's pages, in a real browser (Debian's Chromium, driven by
Playwright) on the shared live stack: only chat models in the Playground and the Quick start (the
platform's default chat model first, a picker for the others, never the embedding model); a message
after revoking a key and rotated keys named apart; the Checkout success page saying only what it knows
(billing is off on this stack); the plans page marking the trial as the current plan and offering no
dead button; and no page, customer's or admin's, scrolling sideways at a phone's width (390 px)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient, new_email, screenshot

pytestmark = pytest.mark.e2e

EMBEDDER = "all-minilm-l6-v2"
OTHER_CHAT = "gemma3-270m"
PHONE = {"width": 390, "height": 844}


def _in_browser(page, client: ConsoleClient) -> None:  # noqa: ANN001 - a Playwright Page
    page.context.add_cookies([{"name": "ff_console", "value": client.session_cookie, "url": client.stack.base_url}])


def _on_trial(stack: Stack) -> ConsoleClient:
    client = ConsoleClient(stack)
    client.email = new_email("pages")  # type: ignore[attr-defined]
    client.signup(client.email)  # type: ignore[attr-defined]
    assert client.post("/console/trial").status_code == 303
    return client


def _listed(stack: Stack, key: str) -> set[str]:
    response = httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return {m["id"] for m in response.json()["data"]}


def test_only_chat_models_in_the_playground_and_quick_start(stack: Stack, page) -> None:  # noqa: ANN001
    """The catalog's embedding model and a second chat model expected (pinned, as an operator keeps them):
    the trial's model lists hold the embedding model, which sorts first, and the pages must not offer it."""
    client = _on_trial(stack)
    _, key = client.create_key("models")
    stack.sql("UPDATE models SET pinned = :p WHERE name IN (:e, :o)", p=True, e=EMBEDDER, o=OTHER_CHAT)
    try:
        eventually(lambda: _listed(stack, key), lambda names: {EMBEDDER, OTHER_CHAT} <= names,
                   "the pinned models in /v1/models")
        _in_browser(page, client)
        page.goto(f"{stack.base_url}/console/quickstart")
        options = page.locator("#qs-model option").all_inner_texts()
        assert options[0] == stack.model and OTHER_CHAT in options and EMBEDDER not in options, options
        for lang in ("curl", "python", "javascript"):
            snippet = page.locator(f"#snippet-{lang}").inner_text()
            assert f'"{stack.model}"' in snippet and EMBEDDER not in snippet, (lang, snippet)
        page.select_option("#qs-model", OTHER_CHAT)  # the picker reloads the page with its model
        page.wait_for_url(f"**/console/quickstart?model={OTHER_CHAT}")
        assert f'"{OTHER_CHAT}"' in page.locator("#snippet-python").inner_text()
        page.goto(f"{stack.base_url}/console/quickstart?model={EMBEDDER}")  # asked for by name: still not
        assert EMBEDDER not in page.locator("#snippet-python").inner_text()
        page.goto(f"{stack.base_url}/console/playground")
        picked = page.locator("#pg-model").input_value()
        offered = page.locator("#pg-model option").all_inner_texts()
        assert picked == stack.model and EMBEDDER not in offered and OTHER_CHAT in offered, (picked, offered)
        # The keys page still offers every model of the plan (a key may be for embeddings).
        page.goto(f"{stack.base_url}/console/keys")
        assert page.locator(f"#create-key input[name='model:{EMBEDDER}']").count() == 1
    finally:
        stack.sql("UPDATE models SET pinned = :p WHERE name IN (:e, :o)", p=False, e=EMBEDDER, o=OTHER_CHAT)
        client.close()


def test_revoke_says_so_rotation_names_apart_success_page_and_plans(stack: Stack, page, tmp_path: Path) -> None:  # noqa: ANN001
    client = _on_trial(stack)
    key_id, _ = client.create_key("backend")
    doomed_id, _ = client.create_key("doomed")
    _in_browser(page, client)
    page.on("dialog", lambda dialog: dialog.accept())
    base = stack.base_url

    page.goto(f"{base}/console/keys")
    page.locator(f"tr[data-key-id='{doomed_id}'] button:has-text('Revoke')").click()
    page.wait_for_url(f"{base}/console/keys?done=revoked")
    assert "revoked" in page.locator("[role=status]").inner_text()
    assert page.locator(f"tr[data-key-id='{doomed_id}']").count() == 0

    days = {datetime.now(UTC).strftime("%Y-%m-%d")}
    page.locator(f"tr[data-key-id='{key_id}'] button:has-text('Rotate')").click()
    page.locator("#new-secret").wait_for()
    days.add(datetime.now(UTC).strftime("%Y-%m-%d"))  # the rotation's day, even across midnight
    names = dict(stack.sql("SELECT id, name FROM api_keys WHERE account_id = (SELECT account_id FROM api_keys "
                           "WHERE id = :k) AND revoked_at IS NULL AND name LIKE 'backend%'", k=key_id))
    assert len(names) == 2 and names[key_id] in {f"backend (rotated {day})" for day in days}, names
    assert sorted(names.values())[0] == "backend"  # the replacement keeps the name code looks for
    assert names[key_id] in page.locator("#new-key").inner_text()
    rows = page.locator("#keys-table tbody tr td:first-child").all_inner_texts()
    assert len({r for r in rows if r.startswith("backend")}) == 2, rows

    # Billing is off on this stack: the success page says that, and claims no payment.
    page.goto(f"{base}/billing/success")
    text = page.locator("#billing-return").inner_text()
    assert page.locator("h1").inner_text() == "Billing is off"
    assert "not set up" in text and "Payment received" not in page.content() and "complete" not in text
    anonymous = httpx.get(f"{base}/billing/success")
    assert "Payment received" not in anonymous.text and "Billing is off" in anonymous.text

    # The plans page marks the trial as this account's plan; no button that does nothing.
    page.goto(f"{base}/console/billing")
    current = page.locator(".plan-card.current")
    assert current.count() == 1 and current.get_attribute("data-plan-card") == "trial"
    assert current.locator(".badge").inner_text() == "current"
    assert page.locator("[data-plan-card=enterprise] button[disabled]").count() == 0
    assert "operator" in page.locator("#contact-sales").inner_text()  # no FLATFARE_SALES_CONTACT here
    screenshot(page, "console-billing-trial", tmp_path)
    client.close()


CUSTOMER_PAGES = ("/console", "/console/keys", "/console/usage", "/console/playground", "/console/quickstart",
                  "/console/billing", "/console/account", "/console/alerts", "/billing/success", "/billing/cancel",
                  "/console/nope")
ANONYMOUS_PAGES = ("/console/login", "/console/login?admin=1", "/console/signup", "/console/reset")
ADMIN_PAGES = ("/console/admin", "/console/admin/accounts", "/console/admin/accounts/{account}",
               "/console/admin/plans", "/console/admin/plans/pro", "/console/admin/models", "/console/admin/usage",
               "/console/admin/audit")


# The phone-width screenshots README links (docs/screenshots with FLATFARE_TEST_SCREENSHOTS=1).
PHONE_SHOTS = {"/console/keys": "console-keys-phone", "/console/usage": "console-usage-phone",
               "/console/quickstart": "console-quickstart-phone", "/console/billing": "console-billing-phone",
               "/console/admin/models": "admin-models-phone"}


def _overflow(page) -> int:  # noqa: ANN001
    """How far the page scrolls sideways (0: not at all)."""
    return page.evaluate("document.documentElement.scrollWidth - window.innerWidth")


def test_no_page_scrolls_sideways_on_a_phone(stack: Stack, browser, tmp_path: Path) -> None:  # noqa: ANN001
    client = _on_trial(stack)
    client.create_key("a key with a rather long name for a narrow screen")
    client.get("/console/keys")
    created = client.post("/console/keys", {"name": "shown once", "daily_limit": "100", "max_inflight": "4"})
    assert created.status_code == 201
    account = stack.sql("SELECT account_id FROM console_users WHERE email = :e", e=client.email)[0][0]  # type: ignore[attr-defined]
    token = stack.cli("admin", "bootstrap", "--name", "phone-widths", "--force")
    assert token.returncode == 0, token.stderr
    admin = ConsoleClient(stack)
    admin.get("/console/login?admin=1")
    assert admin.post("/console/login", {"mode": "admin", "admin_token": token.stdout.strip()}).status_code == 303
    wide: dict[str, int] = {}
    desktop = {"width": 1280, "height": 800}
    for viewport, who, paths in ((PHONE, client, CUSTOMER_PAGES), (PHONE, None, ANONYMOUS_PAGES),
                                 (PHONE, admin, ADMIN_PAGES), (desktop, admin, ("/console/admin/models",))):
        context = browser.new_context(viewport=viewport)
        context.set_default_timeout(60_000)
        if who is not None:
            context.add_cookies([{"name": "ff_console", "value": who.session_cookie, "url": stack.base_url}])
        view = context.new_page()
        try:
            for path in paths:
                view.goto(stack.base_url + path.format(account=account))
                if (over := _overflow(view)) > 0:
                    wide[f"{path} at {viewport['width']} px"] = over
                if path in PHONE_SHOTS and viewport is PHONE:
                    screenshot(view, PHONE_SHOTS[path], tmp_path)
                if path == "/console/admin/models" and viewport is desktop:  # every column in view
                    hidden = view.locator("table").first.evaluate(
                        "t => t.parentElement.scrollWidth - t.parentElement.clientWidth")
                    if hidden > 0:
                        wide["/console/admin/models table at 1280 px"] = hidden
        finally:
            context.close()
    admin.close()
    client.close()
    assert not wide, f"pages wider than the screen (px of sideways scroll): {wide}"
