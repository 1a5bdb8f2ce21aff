"""Quota alerts (flatfare.gateway.quota_alerts, the console's /console/alerts) on the shared live stack: a real
account that spends 80 % of a small daily quota gets one email (without SMTP, in local mode, the gateway's
log) and one signed webhook (a local receiver checks the HMAC), then at 100 % one more of each; a receiver
that fails is tried again and the delivery log shows it; two passes racing record one delivery; a webhook
URL on a private address is refused with a form error. The stack allows http webhooks to 127.0.0.1
(FLATFARE_QUOTA_ALERTS_WEBHOOK_ALLOW_HTTP / _ALLOW_HOSTS) and makes a pass a second."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import DailyQuota
from flatfare.contract import quota_counter_key
from flatfare.gateway.console.mail import LOG_MARK
from flatfare.gateway.jobpath.plan_cache import PlanBook
from flatfare.gateway.quota_alerts import SIGNATURE_HEADER, QuotaAlerts
from flatfare.gateway.settings import GatewaySettings
from flatfare.redis_conn import connect
from flatfare.storage.db import create_engine, session_factory
from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient

pytestmark = pytest.mark.e2e

SECRET = re.compile(r"whsec_[A-Za-z0-9_-]+")


class Receiver:
    """A webhook receiver on 127.0.0.1 that checks each POST's signature; the first ``fail_first`` POSTs
    are answered 500."""

    def __init__(self, fail_first: int = 0) -> None:
        self.secret = ""
        self.fail_first = fail_first
        self.posts: list[tuple[int, dict, bool]] = []  # (status answered, event, signature valid)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                fields = dict(part.split("=", 1) for part in self.headers.get(SIGNATURE_HEADER, "").split(","))
                expected = hmac.new(receiver.secret.encode(), f"{fields.get('t')}.".encode() + body,
                                    hashlib.sha256).hexdigest()
                valid = hmac.compare_digest(expected, fields.get("v1", "")) and abs(
                    time.time() - int(fields.get("t", "0"))) < 300
                status = 500 if len(receiver.posts) < receiver.fail_first else 200
                receiver.posts.append((status, json.loads(body), valid))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/flatfare-alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self, threshold: int) -> list[dict]:
        return [event for status, event, _ in self.posts
                if status == 200 and event["data"]["threshold_percent"] == threshold]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail_first=1)
    yield r
    r.server.shutdown()


def _account_of(stack: Stack, email: str) -> int:
    return stack.sql("SELECT account_id FROM console_users WHERE email = :e", e=email)[0][0]


def _emails(stack: Stack, email: str, threshold: int) -> list[str]:
    log = (stack.logs / "gateway.log").read_text(errors="replace")
    return [line for line in log.splitlines()
            if LOG_MARK in line and email in line and f"reached {threshold} % of its daily quota" in line]


def _ask(stack: Stack, key: str) -> None:
    answer = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": stack.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert answer.status_code == 200, answer.text


def _log_row(customer: ConsoleClient, threshold: int, channel: str) -> str:
    page = customer.get("/console/alerts").text
    match = re.search(rf'<tr data-delivery="{threshold}-{channel}"[^>]*>.*?</tr>', page, re.S)
    return match.group(0) if match else ""


def test_an_account_is_alerted_once_by_email_and_signed_webhook_at_80_and_100_percent(
        stack: Stack, customer: ConsoleClient, receiver: Receiver) -> None:
    email = customer.email  # type: ignore[attr-defined]
    stack.sql("UPDATE accounts SET daily_limit_override = 5 WHERE id = :a", a=_account_of(stack, email))
    page = customer.get("/console/alerts")
    assert page.status_code == 200 and 'value="80, 100"' in page.text  # on by default
    saved = customer.post("/console/alerts", {"thresholds": "80, 100", "email": "on", "webhook_url": receiver.url})
    assert saved.status_code == 303, saved.text
    secret = SECRET.search(customer.get("/console/alerts").text)
    assert secret, "the webhook's signing secret is not on the page"
    receiver.secret = secret.group(0)
    _, key = customer.create_key("alerts")

    for _ in range(4):  # 4 of 5: 80 %
        _ask(stack, key)
    eventually(lambda: receiver.delivered(80), bool, "the 80 % webhook", timeout_s=60)
    eventually(lambda: _emails(stack, email, 80), bool, "the 80 % email", timeout_s=60)
    # The receiver's first answer was a 500: tried again, and the log says so.
    row = eventually(lambda: _log_row(customer, 80, "webhook"), lambda r: 'data-status="sent"' in r, "the log")
    assert 'data-attempts="2"' in row and "HTTP 500" in row, row
    assert receiver.delivered(100) == [] and _emails(stack, email, 100) == []

    _ask(stack, key)  # 5 of 5: 100 %
    eventually(lambda: receiver.delivered(100), bool, "the 100 % webhook", timeout_s=60)
    eventually(lambda: _emails(stack, email, 100), bool, "the 100 % email", timeout_s=60)
    time.sleep(3)  # a few more passes (one a second): nothing is sent twice
    assert [len(receiver.delivered(t)) for t in (80, 100)] == [1, 1]
    assert len(receiver.posts) == 3  # the failed try, then one each
    assert all(valid for _, _, valid in receiver.posts), "a webhook's signature did not verify"
    assert [len(_emails(stack, email, t)) for t in (80, 100)] == [1, 1]
    event = receiver.delivered(100)[0]
    assert event["type"] == "quota.threshold_reached" and event["data"]["used"] == 5
    assert event["data"]["daily_limit"] == 5


def test_a_webhook_on_a_private_address_is_refused_with_a_form_error(stack: Stack, customer: ConsoleClient) -> None:
    customer.get("/console/alerts")
    for url, why in (("https://10.0.0.7/hook", "not a public address"),
                     ("https://169.254.169.254/latest", "not a public address"),
                     ("https://localhost/hook", "not a public name"),
                     ("ftp://example.com/hook", "must start with https")):
        answer = customer.post("/console/alerts", {"thresholds": "80, 100", "email": "on", "webhook_url": url})
        assert answer.status_code == 400, url
        assert why in answer.text, (url, answer.text[-2000:])
    account_id = _account_of(stack, customer.email)  # type: ignore[attr-defined]
    assert stack.sql("SELECT count(*) FROM quota_alert_settings WHERE account_id = :a", a=account_id) == [(0,)]


def test_two_passes_racing_record_one_delivery_per_threshold(stack: Stack, customer: ConsoleClient) -> None:
    account_id = _account_of(stack, customer.email)  # type: ignore[attr-defined]
    stack.sql("UPDATE accounts SET daily_limit_override = 4 WHERE id = :a", a=account_id)
    timezone = stack.sql("SELECT p.timezone FROM accounts a JOIN plans p ON p.name = a.plan WHERE a.id = :a",
                         a=account_id)[0][0]
    day = quota_window(timezone, datetime.now(UTC)).day
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        client.set(quota_counter_key(account_id, day), 4, ex=86400)  # as if 4 of 4 requests were made
    finally:
        client.close()

    async def race() -> list[int]:
        engines = [create_engine(stack.database_url) for _ in range(3)]
        redis = connect(stack.redis_url)
        try:
            passes = []
            for engine in engines:
                sessions = session_factory(engine)
                quota = DailyQuota(redis, None)  # type: ignore[arg-type] - no rebuild here
                passes.append(QuotaAlerts(sessions, quota, PlanBook(sessions, 1), GatewaySettings.model_construct()))
            return await asyncio.gather(*(p.record_crossings() for p in passes))
        finally:
            await redis.aclose()
            for engine in engines:
                await engine.dispose()

    inserted = asyncio.run(race())
    rows = stack.sql("SELECT threshold, channel FROM quota_alert_deliveries WHERE account_id = :a ORDER BY threshold",
                     a=account_id)
    assert rows == [(80, "email"), (100, "email")], rows
    assert sum(inserted) <= 2


def test_the_admin_api_reads_and_sets_an_accounts_alerts_without_its_secret(stack: Stack,
                                                                             customer: ConsoleClient) -> None:
    account_id = _account_of(stack, customer.email)  # type: ignore[attr-defined]
    token = stack.cli("admin", "bootstrap", "--name", "quota-alerts", "--force")
    assert token.returncode == 0, token.stderr
    admin = httpx.Client(base_url=f"{stack.base_url}/admin/v1", timeout=30,
                         headers={"Authorization": f"Bearer {token.stdout.strip()}"})
    try:
        path = f"/accounts/{account_id}/quota-alerts"
        assert admin.get(path).json() == {"thresholds": [80, 100], "email": True, "webhook_url": None,
                                          "has_webhook_secret": False}
        refused = admin.put(path, json={"thresholds": [50], "webhook_url": "https://192.168.1.10/hook"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "webhook_url", refused.text
        hook = "http://127.0.0.1:9/hook"  # the stack exempts 127.0.0.1
        answer = admin.put(path, json={"thresholds": [90, 50], "email": False, "webhook_url": hook})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"thresholds": [50, 90], "email": False, "webhook_url": hook,
                                 "has_webhook_secret": True}
        assert "whsec_" not in answer.text
        secret = stack.sql("SELECT webhook_secret FROM quota_alert_settings WHERE account_id = :a", a=account_id)
        assert secret[0][0].startswith("whsec_")
        assert secret[0][0] in customer.get("/console/alerts").text  # the owner sees it
        audit = stack.sql("SELECT after FROM audit_log WHERE action = 'account.quota_alerts' AND resource_id = :a",
                          a=str(account_id))
        assert audit and "whsec_" not in str(audit)
        assert admin.get("/accounts/999999/quota-alerts").status_code == 404
    finally:
        admin.close()


# Last in the module: the browser fixture's event loop must not outlive into an asyncio.run() above.
def test_in_a_browser_a_private_webhook_url_gets_a_form_error(stack: Stack, customer: ConsoleClient,
                                                               page) -> None:  # noqa: ANN001 - a Playwright Page
    page.context.add_cookies([{"name": "ff_console", "value": customer.session_cookie, "url": stack.base_url}])
    page.goto(f"{stack.base_url}/console/alerts")
    assert page.locator("input[name=thresholds]").input_value() == "80, 100"
    assert page.locator("input[name=email]").is_checked()
    page.fill("input[name=webhook_url]", "https://192.168.0.10/flatfare")
    page.click("#alerts-form button[type=submit]")
    error = page.locator("[role=alert]")
    assert "not a public address" in error.inner_text()
    assert page.locator("input[name=webhook_url]").input_value() == "https://192.168.0.10/flatfare"  # kept to fix
    assert page.locator("#webhook-secret").count() == 0
