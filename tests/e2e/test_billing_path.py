"""Stripe billing end to end: localstripe for customers, subscriptions and signed webhooks; what it
lacks (Checkout, the portal, meter events) is answered at the HTTP edge by a small recording server
in front of it (bench.stripe_edge), never by faking the SDK."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from bench.stripe_edge import StripeEdge
from flatfare.billing.plans import quota_window
from flatfare.redis_local import free_port
from tests.conftest import eventually, launch_stack

pytestmark = pytest.mark.e2e

SECRET = "whsec_flatfare_test"
# The operator's sales contact, shown on the console's plans page (tests/console/test_billing_pages.py).
SALES = "sales@flatfare.test"
PRICES = {"pro": "price_pro", "premium": "price_premium", "free": "price_free"}
# The seeded plans have no per-request price (0010); premium gets an operator's here, with its metered
# Stripe price, so its requests are metered; pro stays flat unless a test gives it a price.
PREMIUM_PRICE_MICROS = 1500
METERED = {"premium": "price_premium_requests"}
MODEL = "instant"


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/customers", headers={"Authorization": "Bearer sk_test_x"})
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("localstripe did not start")


@pytest.fixture(scope="module")
def billing(tmp_path_factory) -> Iterator[tuple]:
    port = free_port()
    localstripe = subprocess.Popen([sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port)
    stripe_url = f"http://127.0.0.1:{port}"
    edge = StripeEdge(stripe_url).start()
    env = {"FLATFARE_STRIPE_API_KEY": "sk_test_flatfare", "FLATFARE_STRIPE_WEBHOOK_SECRET": SECRET,
           "FLATFARE_STRIPE_API_BASE": edge.url, "FLATFARE_STRIPE_PRICES": json.dumps(PRICES),
           "FLATFARE_STRIPE_METERED_PRICES": json.dumps(METERED),
           "FLATFARE_STRIPE_BATCH_METERED_PRICES": json.dumps({"premium": "price_premium_batch"}),
           "FLATFARE_BILLING_OUTBOX_INTERVAL_S": "0.2", "FLATFARE_AUTH_CACHE_TTL_S": "0.1",
           "FLATFARE_PLANS_CACHE_TTL_S": "0.1", "FLATFARE_SALES_CONTACT": SALES}
    try:
        with launch_stack(tmp_path_factory.mktemp("billing"), model=MODEL, worker_args=("--engine", "instant"),
                          env=env, account_plan="free",
                          before_start=(f"UPDATE plans SET price_per_request_micros = {PREMIUM_PRICE_MICROS} "
                                        "WHERE name = 'premium'",)) as stack:
            ls = httpx.Client(base_url=stripe_url, headers={"Authorization": "Bearer sk_test_flatfare"})
            ls.post("/_config/webhooks/flatfare", data={"url": f"{stack.base_url}/billing/stripe/webhook",
                                                        "secret": SECRET})
            ls.post("/v1/products", data={"id": "prod_flatfare", "name": "Flatfare", "type": "service"})
            for plan, price in PRICES.items():
                ls.post("/v1/plans", data={"id": price, "product": "prod_flatfare", "amount": 2000,
                                           "currency": "usd", "interval": "month", "nickname": plan})
            yield stack, edge, ls
    finally:
        edge.stop()
        localstripe.terminate()
        localstripe.wait(10)


def _plan(stack, name: str) -> tuple[str, str]:
    return stack.sql("SELECT plan, status FROM accounts WHERE name = :n", n=name)[0]


def _wait_for(predicate, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _signed(payload: dict, secret: str = SECRET, at: int | None = None) -> tuple[bytes, str]:
    body = json.dumps(payload).encode()
    at = at or int(time.time())
    signature = hmac.new(secret.encode(), b"%d.%s" % (at, body), hashlib.sha256).hexdigest()
    return body, f"t={at},v1={signature}"


def _post_event(stack, payload: dict, **kwargs) -> httpx.Response:
    body, signature = _signed(payload, **kwargs)
    return httpx.post(f"{stack.base_url}/billing/stripe/webhook", content=body,
                      headers={"Stripe-Signature": signature, "Content-Type": "application/json"})


def test_checkout_then_webhooks_move_the_plan_and_cancellation_moves_it_back(billing) -> None:
    stack, edge, ls = billing
    auth = {"Authorization": f"Bearer {stack.api_key}"}
    assert _plan(stack, "e2e") == ("free", "active")
    checkout = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "premium"}, headers=auth)
    assert checkout.status_code == 200, checkout.text
    assert checkout.json()["url"].startswith("https://checkout.stripe.test/")
    sent = edge.checkouts[-1]
    customer = stack.sql("SELECT stripe_customer_id FROM accounts WHERE name = 'e2e'")[0][0]
    assert customer and customer.startswith("cus_")
    assert (sent["customer"], sent["mode"], sent["line_items[0][price]"]) == (customer, "subscription",
                                                                               "price_premium")
    portal = httpx.post(f"{stack.base_url}/v1/billing/portal", headers=auth)
    assert portal.status_code == 200 and portal.json()["url"].startswith("https://billing.stripe.test/")

    # What Stripe Checkout does once the developer pays: a card on the customer, then the subscription.
    card = ls.post("/v1/payment_methods", data={"type": "card", "card[number]": "4242424242424242",
                                                 "card[exp_month]": "12", "card[exp_year]": "2030",
                                                 "card[cvc]": "123"}).json()
    ls.post(f"/v1/payment_methods/{card['id']}/attach", data={"customer": customer})
    ls.post(f"/v1/customers/{customer}", data={"invoice_settings[default_payment_method]": card["id"]})
    subscription = ls.post("/v1/subscriptions", data={"customer": customer, "items[0][plan]": "price_premium"})
    assert subscription.status_code == 200, subscription.text
    _wait_for(lambda: _plan(stack, "e2e")[0] == "premium")

    events = stack.sql("SELECT id FROM stripe_events WHERE type = 'customer.subscription.created'")
    assert len(events) == 1
    ls.delete(f"/v1/subscriptions/{subscription.json()['id']}")
    _wait_for(lambda: _plan(stack, "e2e")[0] == "free")


def test_replayed_forged_stale_and_late_events_change_nothing(billing) -> None:
    stack, _, ls = billing
    customer = stack.sql("SELECT stripe_customer_id FROM accounts WHERE name = 'e2e'")[0][0]
    before = _plan(stack, "e2e")
    now = int(time.time())
    upgrade = {"id": "evt_replay_1", "type": "customer.subscription.updated", "created": now,
               "data": {"object": {"id": "sub_x", "customer": customer, "status": "active",
                                   "items": {"data": [{"price": {"id": "price_pro"}}]}}}}
    first = _post_event(stack, upgrade)
    assert first.status_code == 200 and _plan(stack, "e2e")[0] == "pro"
    stack.sql("UPDATE accounts SET plan = 'free' WHERE name = 'e2e'")
    replay = _post_event(stack, upgrade)
    assert replay.json()["outcome"] == "duplicate" and _plan(stack, "e2e")[0] == "free"

    late = {**upgrade, "id": "evt_late", "created": now - 3600}  # older than what was applied
    assert _post_event(stack, late).json()["outcome"] == "stale" and _plan(stack, "e2e")[0] == "free"

    forged = _post_event(stack, {**upgrade, "id": "evt_forged"}, secret="whsec_wrong")
    stale = _post_event(stack, {**upgrade, "id": "evt_old"}, at=now - 1000)
    unsigned = httpx.post(f"{stack.base_url}/billing/stripe/webhook", content=json.dumps(upgrade).encode())
    assert [r.status_code for r in (forged, stale, unsigned)] == [400, 400, 400]
    assert _plan(stack, "e2e") == before
    ids = {row[0] for row in stack.sql("SELECT id FROM stripe_events")}
    assert not ids & {"evt_forged", "evt_old"}


def test_payment_failure_makes_the_account_past_due(billing) -> None:
    stack, _, _ = billing
    out = stack.cli("keys", "create", "--account", "late-payer", "--plan", "pro")
    key = out.stdout.strip()
    stack.sql("UPDATE accounts SET stripe_customer_id = 'cus_late', stripe_subscription_id = 'sub_late' "
              "WHERE name = 'late-payer'")
    now = int(time.time())
    failed = {"id": "evt_pay_failed", "type": "invoice.payment_failed", "created": now,
              "data": {"object": {"id": "in_1", "customer": "cus_late", "subscription": "sub_late"}}}
    assert _post_event(stack, failed).status_code == 200
    refused = eventually(lambda: httpx.post(f"{stack.base_url}/v1/chat/completions",
                                            headers={"Authorization": f"Bearer {key}"},
                                            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                         lambda r: r.status_code != 200, "the account past due, past the auth cache")
    assert refused.status_code == 403 and "past due" in refused.json()["error"]["message"]
    paid = {**failed, "id": "evt_paid", "type": "invoice.payment_succeeded", "created": now + 1}
    assert _post_event(stack, paid).status_code == 200
    assert _plan(stack, "late-payer") == ("pro", "active")


def test_meter_events_are_retried_and_sent_once_per_request(billing) -> None:
    stack, edge, _ = billing
    out = stack.cli("keys", "create", "--account", "metered", "--plan", "premium")  # priced per request
    key = out.stdout.strip()
    stack.sql("UPDATE accounts SET stripe_customer_id = 'cus_metered' WHERE name = 'metered'")
    account_id = stack.sql("SELECT id FROM accounts WHERE name = 'metered'")[0][0]
    edge.fail_meter_events = 2  # the first two deliveries fail: backoff, then retry
    ids = []
    for _ in range(5):
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200
        ids.append(response.headers["x-request-id"])

    def all_sent() -> bool:
        rows = stack.sql("SELECT status FROM usage_outbox WHERE account_id = :a", a=account_id)
        return len(rows) == 5 and all(r[0] == "sent" for r in rows)

    _wait_for(all_sent, timeout_s=30)
    mine = [e for e in edge.meter_events if e["payload[stripe_customer_id]"] == "cus_metered"]
    assert sorted(e["identifier"] for e in mine) == sorted(ids)  # each request once, none lost
    assert {e["event_name"] for e in mine} == {"flatfare_requests"}
    retried = stack.sql("SELECT max(attempts) FROM usage_outbox WHERE account_id = :a", a=account_id)[0][0]
    assert retried >= 2

    # Reconciliation puts back a row that went missing and the sender delivers it.
    stack.sql("DELETE FROM usage_outbox WHERE request_id = :r", r=ids[0])
    day = quota_window("UTC", datetime.now(UTC)).day
    report = stack.cli("billing", "reconcile", "--day", day)
    assert report.returncode == 0 and "1 missing rows queued" in report.stdout
    _wait_for(lambda: stack.sql("SELECT status FROM usage_outbox WHERE request_id = :r", r=ids[0]) == [("sent",)])


def test_checkout_refuses_plans_without_a_price(billing) -> None:
    stack, _, _ = billing
    response = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "enterprise"},
                          headers={"Authorization": f"Bearer {stack.api_key}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "plan"


def test_checkout_attaches_the_metered_price_of_a_plan_that_charges_per_request(billing) -> None:
    """Premium charges per request here: its Checkout carries the monthly price and the metered one, so
    Stripe invoices the requests; free and pro as seeded charge nothing per request: their monthly price
    alone; pro given a per-request price with no metered price configured: refused, never sold without it."""
    stack, edge, _ = billing
    auth = {"Authorization": f"Bearer {stack.api_key}"}
    premium = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "premium"}, headers=auth)
    assert premium.status_code == 200, premium.text
    sent = edge.checkouts[-1]
    assert (sent["line_items[0][price]"], sent["line_items[0][quantity]"]) == ("price_premium", "1")
    assert sent["line_items[1][price]"] == "price_premium_requests"
    assert "line_items[1][quantity]" not in sent  # a metered price takes no quantity
    # And its Batch API lines' meter, priced at the batch discount.
    assert sent["line_items[2][price]"] == "price_premium_batch" and "line_items[2][quantity]" not in sent
    free = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "free"}, headers=auth)
    assert free.status_code == 200, free.text
    assert edge.checkouts[-1]["line_items[0][price]"] == "price_free"
    assert not any(name.startswith("line_items[1]") for name in edge.checkouts[-1])
    # A stock deployment sells Pro: flat monthly, no metered price needed.
    pro = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "pro"}, headers=auth)
    assert pro.status_code == 200, pro.text
    assert edge.checkouts[-1]["line_items[0][price]"] == "price_pro"
    assert not any(name.startswith("line_items[1]") for name in edge.checkouts[-1])
    stack.sql("UPDATE plans SET price_per_request_micros = 2000 WHERE name = 'pro'")
    try:
        eventually(lambda: httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "pro"}, headers=auth),
                   lambda r: r.status_code != 200, "pro's per-request price, past the plans cache")
        count = len(edge.checkouts)
        pro = httpx.post(f"{stack.base_url}/v1/billing/checkout", json={"plan": "pro"}, headers=auth)
        assert pro.status_code == 503, pro.text
        assert pro.json()["error"]["code"] == "billing_not_configured"
        assert "FLATFARE_STRIPE_METERED_PRICES" in pro.json()["error"]["message"]
        assert len(edge.checkouts) == count  # nothing reached Stripe
    finally:
        stack.sql("UPDATE plans SET price_per_request_micros = 0 WHERE name = 'pro'")
