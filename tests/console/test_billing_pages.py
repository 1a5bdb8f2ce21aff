"""The plan and billing page in a real browser (Debian's Chromium, driven by Playwright), against
localstripe behind the Stripe edge of tests/e2e/test_billing_path.py (its module stack, instant engine):
a Free customer buys Premium through Checkout, Stripe's webhook lands, the plan changes on the return
page and the billing page (the success page says it waits for Stripe's confirmation until the webhook
has recorded it); the cancel page says nothing was charged; no customer can see or act on another's
billing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import eventually
from tests.console.conftest import ConsoleClient, new_email, screenshot
from tests.e2e.test_billing_path import SALES, billing  # noqa: F401 - the module's Stripe-enabled stack

pytestmark = pytest.mark.e2e
CHECKOUT = "https://checkout.stripe.test/"


def _signed_up(stack) -> ConsoleClient:  # noqa: ANN001
    client = ConsoleClient(stack)
    client.email = new_email("buyer")  # type: ignore[attr-defined]
    client.signup(client.email)  # type: ignore[attr-defined]
    return client


def _in_browser(page, client: ConsoleClient) -> None:  # noqa: ANN001 - a Playwright Page
    """The browser takes the httpx client's session cookie; Stripe's hosted pages are answered at the
    browser's own network edge (no internet here)."""
    page.context.add_cookies([{"name": "ff_console", "value": client.session_cookie, "url": client.stack.base_url}])
    page.route(f"{CHECKOUT}**", lambda route: route.fulfill(
        status=200, content_type="text/html", body="<h1>Stripe Checkout (test)</h1>"))


def _account(stack, email: str) -> tuple[int, str, str | None]:  # noqa: ANN001
    return stack.sql("SELECT a.id, a.plan, a.stripe_customer_id FROM accounts a JOIN console_users u "
                     "ON u.account_id = a.id WHERE u.email = :e", e=email)[0]


def test_buying_premium_through_checkout_changes_the_plan_shown(billing, page, tmp_path: Path) -> None:  # noqa: F811
    stack, edge, ls = billing
    client = _signed_up(stack)
    _in_browser(page, client)
    base = stack.base_url
    page.goto(f"{base}/console/billing")
    assert page.locator("#current-plan").get_attribute("data-plan") == "free"
    assert page.locator("[data-plan-card=premium] .plan-price").inner_text().startswith("$350")
    assert page.locator("[data-plan-card=pro] .plan-price").inner_text().startswith("$80")
    # Enterprise: the operator's sales contact (FLATFARE_SALES_CONTACT) as a link, not a dead button.
    assert page.locator("#contact-sales").get_attribute("href").startswith(f"mailto:{SALES}?subject=")
    assert page.locator("[data-plan-card=enterprise] button[disabled]").count() == 0
    screenshot(page, "console-billing", tmp_path)

    # Upgrade: off to Checkout, with the plan's monthly and metered prices, for this account's customer.
    page.click("[data-buy=premium]")
    page.wait_for_url(f"{CHECKOUT}**")
    account_id, plan, customer = _account(stack, client.email)
    assert plan == "free" and customer and customer.startswith("cus_")
    sent = edge.checkouts[-1]
    assert (sent["customer"], sent["client_reference_id"]) == (customer, str(account_id))
    assert (sent["line_items[0][price]"], sent["line_items[1][price]"]) == ("price_premium", "price_premium_requests")
    # Back to the platform's public URL (the test stack leaves it at its default).
    assert sent["success_url"].endswith("/billing/success") and sent["cancel_url"].endswith("/billing/cancel")

    # Stripe returns the buyer before its webhook has landed: the page says it is waiting for Stripe's
    # confirmation of Premium (no thank-you for a payment it has not seen) and shows the plan as it is.
    page.goto(f"{base}/billing/success")
    outcome = page.locator("#checkout-outcome")
    assert outcome.get_attribute("data-state") == "waiting" and "Premium" in outcome.inner_text()
    assert "Waiting for payment confirmation" in outcome.inner_text()
    assert "Payment received" not in page.content() and "Checkout is complete" not in page.content()
    assert page.locator("#current-plan").get_attribute("data-plan") == "free"
    # What Checkout does once the buyer pays (as tests/e2e/test_billing_path.py): a card, then the subscription.
    card = ls.post("/v1/payment_methods", data={"type": "card", "card[number]": "4242424242424242",
                                                 "card[exp_month]": "12", "card[exp_year]": "2030",
                                                 "card[cvc]": "123"}).json()
    ls.post(f"/v1/payment_methods/{card['id']}/attach", data={"customer": customer})
    ls.post(f"/v1/customers/{customer}", data={"invoice_settings[default_payment_method]": card["id"]})
    subscription = ls.post("/v1/subscriptions", data={"customer": customer, "items[0][plan]": "price_premium"})
    assert subscription.status_code == 200, subscription.text
    # The webhook lands; the return page, polling, shows the confirmation and the new plan without a reload.
    page.locator("#checkout-outcome[data-state=confirmed]").wait_for(timeout=60_000)
    assert "Payment confirmed" in page.locator("#checkout-outcome").inner_text()
    assert "Premium" in page.locator("#current-plan").inner_text()
    screenshot(page, "console-billing-success", tmp_path)
    page.goto(f"{base}/console/billing")
    assert page.locator("#current-plan").inner_text() == "Premium"
    assert page.locator("[data-plan-card=premium] .badge").inner_text() == "current"
    assert page.locator("#manage-billing").count() == 1  # a Stripe customer now: the portal is offered
    ls.delete(f"/v1/subscriptions/{subscription.json()['id']}")
    eventually(lambda: _account(stack, client.email)[1], lambda plan: plan == "free", "back on free", timeout_s=60)
    client.close()


def test_the_cancel_page_says_nothing_was_charged(billing, page, tmp_path: Path) -> None:  # noqa: F811
    stack, _, _ = billing
    anonymous = httpx.get(f"{stack.base_url}/billing/cancel")
    assert anonymous.status_code == 200 and "Checkout cancelled" in anonymous.text
    assert "Log in to see your plan" in anonymous.text
    assert "frame-ancestors" in anonymous.headers["content-security-policy"]  # the console's headers
    client = _signed_up(stack)
    _in_browser(page, client)
    page.goto(f"{stack.base_url}/billing/cancel")
    assert "Nothing was charged" in page.locator("#billing-return").inner_text()
    assert page.locator("#current-plan").get_attribute("data-plan") == "free"
    screenshot(page, "console-billing-cancel", tmp_path)
    client.close()


def test_no_customer_reaches_another_customers_billing(billing) -> None:  # noqa: F811
    stack, edge, _ = billing
    alice, bob = _signed_up(stack), _signed_up(stack)
    alice_id = _account(stack, alice.email)[0]
    stack.sql("UPDATE accounts SET plan = 'pro', stripe_customer_id = 'cus_alice' WHERE id = :a", a=alice_id)
    # Bob's pages show Bob's plan, whatever ids he puts in the URL.
    for path in ("/console/billing", f"/console/billing?account_id={alice_id}", "/console/billing/status",
                 f"/console/billing/status?account_id={alice_id}", "/billing/success"):
        response = bob.get(path)
        assert response.status_code == 200, path
        assert 'data-plan="free"' in response.text and 'data-plan="pro"' not in response.text, path
    # Bob's checkout and portal are his own customer's, never Alice's.
    bob.get("/console/billing")
    response = bob.post("/console/billing/checkout", {"plan": "premium", "account_id": str(alice_id)})
    assert response.status_code == 303, response.text
    bob_customer = _account(stack, bob.email)[2]
    assert edge.checkouts[-1]["customer"] == bob_customer != "cus_alice"
    assert edge.checkouts[-1]["client_reference_id"] != str(alice_id)
    # A form without the session's CSRF token changes nothing; logged out, a redirect to the login.
    count = len(edge.checkouts)
    assert bob.post("/console/billing/checkout", {"plan": "premium"}, csrf=False).status_code == 403
    assert bob.post("/console/billing/portal", {"return": "x"}, csrf=False).status_code == 403
    assert len(edge.checkouts) == count
    anonymous = httpx.post(f"{stack.base_url}/console/billing/checkout", data={"plan": "premium"})
    assert anonymous.status_code in (401, 403)
    assert httpx.get(f"{stack.base_url}/console/billing").status_code == 303
    # A plan that cannot be bought is refused on the page, not sent to Stripe.
    bob.get("/console/billing")
    refused = bob.post("/console/billing/checkout", {"plan": "enterprise"})
    assert refused.status_code == 400 and "cannot be bought" in refused.text
    # Through htmx (as the page posts) the refusal replaces the page, since htmx swaps only 2xx answers.
    bob.get("/console/billing")
    swapped = bob.http.post("/console/billing/checkout", data={"plan": "enterprise", "csrf_token": bob.csrf},
                            headers={"HX-Request": "true"})
    assert swapped.status_code == 200 and swapped.headers["hx-retarget"] == "body"
    assert "cannot be bought" in swapped.text and "hx-redirect" not in swapped.headers
    assert len(edge.checkouts) == count
    # Pro given a per-request price by the operator, with no metered price configured: refused.
    stack.sql("UPDATE plans SET price_per_request_micros = 2000 WHERE name = 'pro'")
    try:
        bought = eventually(lambda: bob.http.post("/console/billing/checkout",
                                                  data={"plan": "pro", "csrf_token": bob.csrf},
                                                  headers={"HX-Request": "true"}),
                            lambda r: "hx-redirect" not in r.headers, "pro's per-request price, past the plans cache")
        assert bought.status_code == 200 and "FLATFARE_STRIPE_METERED_PRICES" in bought.text
    finally:
        stack.sql("UPDATE plans SET price_per_request_micros = 0 WHERE name = 'pro'")
    going = bob.http.post("/console/billing/checkout", data={"plan": "premium", "csrf_token": bob.csrf},
                          headers={"HX-Request": "true"})
    assert going.status_code == 204 and going.headers["hx-redirect"].startswith("https://checkout.stripe.test/")
    alice.close()
    bob.close()
