"""Shared-key detection (flatfare.gateway.shared_keys) on the shared live stack: a key used from more client
addresses in a day than its plan's threshold is flagged: its owner sees a banner in the console (a real
browser) and gets one email (without SMTP, in local mode, the gateway's log), the operator sees it on the
admin dashboard and the account's page; with the plan's cap on addresses at once, a request from yet
another address is refused (429 key_shared_too_widely) with nothing taken: no ledger row, no quota unit.
The stack trusts its loopback proxy (FLATFARE_FORWARDED_ALLOW_IPS), so X-Forwarded-For names each client."""

from __future__ import annotations

import re
import secrets

import httpx
import pytest

from flatfare.gateway.console.mail import LOG_MARK
from flatfare.gateway.console.shared_key_notice import SUBJECT
from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient

pytestmark = pytest.mark.e2e

PLAN_COLUMNS = ("display_name, daily_limit, price_per_request_micros, monthly_price_cents, lane, allowed_models, "
                "max_output_tokens, max_prompt_tokens, max_n, max_body_bytes, max_inflight, max_embedding_inputs, "
                "timezone, trial_days, retired, batch_discount_percent, batch_daily_limit")


def _on_watched_plan(stack: Stack, account_id: int, alert_at: int, max_addresses: int | None) -> str:
    """The account on a copy of Pro (retired: no one else is offered it) with the shared-key rules given."""
    name = f"watched-{secrets.token_hex(3)}"
    stack.sql(f"INSERT INTO plans (name, {PLAN_COLUMNS}, shared_key_alert_addresses, shared_key_max_addresses) "
              f"SELECT :name, {PLAN_COLUMNS.replace('retired', 'true')}, :alert, :most FROM plans WHERE name = 'pro'",
              name=name, alert=alert_at, most=max_addresses)
    stack.sql("UPDATE accounts SET plan = :p WHERE id = :a", p=name, a=account_id)
    return name


def _ask(stack: Stack, key: str, address: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": address,
                               "User-Agent": f"client-{address}"},
                      json={"model": stack.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})


def _notices(stack: Stack, email: str) -> list[str]:
    log = (stack.logs / "gateway.log").read_text(errors="replace")
    return [line for line in log.splitlines() if LOG_MARK in line and email in line and SUBJECT in line]


def _account_of(stack: Stack, email: str) -> int:
    return stack.sql("SELECT account_id FROM console_users WHERE email = :e", e=email)[0][0]


def test_a_key_used_from_many_addresses_is_flagged_to_its_owner_and_the_operator(
        stack: Stack, customer: ConsoleClient, page) -> None:  # noqa: ANN001 - a Playwright Page
    email = customer.email  # type: ignore[attr-defined]
    account_id = _account_of(stack, email)
    _on_watched_plan(stack, account_id, alert_at=2, max_addresses=None)
    key_id, key = customer.create_key("team key")
    for n in range(1, 5):  # four addresses, past a threshold of two
        answer = _ask(stack, key, f"203.0.113.{n}")
        assert answer.status_code == 200, answer.text

    # The owner: one email, however many gateway passes run...
    notices = eventually(lambda: _notices(stack, email), bool, "the shared-key email in the gateway's log")
    # The pass may run between the third request (the one past the threshold) and the fourth: the email
    # counts what the key had when it was sent.
    told = re.search(r"from (\d+) different client addresses with (\d+) different user agents", notices[0])
    assert told and told.group(1) == told.group(2) and int(told.group(1)) in (3, 4), notices[0]
    # ...and a banner on the console's overview and Keys pages.
    page.context.add_cookies([{"name": "ff_console", "value": customer.session_cookie, "url": stack.base_url}])
    for path in ("/console", "/console/keys"):
        page.goto(f"{stack.base_url}{path}")
        banner = page.locator(f"[data-shared-key='{key_id}']")
        assert banner.count() == 1, path
        assert "used today from 4 different client addresses" in banner.inner_text()
    assert len(_notices(stack, email)) == 1, "one email a key and day"

    # The operator: on the dashboard and the account's page.
    token = stack.cli("admin", "bootstrap", "--name", "shared-keys", "--force")
    assert token.returncode == 0, token.stderr
    admin = ConsoleClient(stack)
    try:
        admin.get("/console/login?admin=1")
        assert admin.post("/console/login", {"mode": "admin", "admin_token": token.stdout.strip()}).status_code == 303
        dashboard = admin.get("/console/admin").text
        assert "Shared keys today" in dashboard and f"/console/admin/accounts/{account_id}" in dashboard
        assert f'data-shared-key="{key_id}"' in admin.get(f"/console/admin/accounts/{account_id}").text
    finally:
        admin.close()


def test_with_a_cap_a_new_address_is_refused_and_nothing_is_taken(stack: Stack, customer: ConsoleClient) -> None:
    email = customer.email  # type: ignore[attr-defined]
    account_id = _account_of(stack, email)
    _on_watched_plan(stack, account_id, alert_at=100, max_addresses=2)
    key_id, key = customer.create_key("capped")
    for address in ("198.51.100.1", "198.51.100.2"):
        assert _ask(stack, key, address).status_code == 200
    rows = stack.sql("SELECT count(*) FROM requests WHERE api_key_id = :k", k=key_id)

    refused = _ask(stack, key, "198.51.100.3")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "key_shared_too_widely"
    assert "Retry-After" in refused.headers
    assert stack.sql("SELECT count(*) FROM requests WHERE api_key_id = :k", k=key_id) == rows == [(2,)]
    # The quota: the account's remaining requests are as before the refusal.
    again = _ask(stack, key, "198.51.100.1")
    assert again.status_code == 200, "an address already seen still gets in"
    assert again.headers["x-ratelimit-remaining-requests"] == str(int(again.headers["x-ratelimit-limit-requests"]) - 3)
