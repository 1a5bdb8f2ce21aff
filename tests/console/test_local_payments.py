"""``flatfare up --payments local``'s Stripe stand-in (flatfare/cli/local_payments.py): localstripe with the
plans' prices and its webhooks wired to the gateway, and a test Checkout page. A newcomer buys Premium in
the console in a real browser (Chromium): the console's upgrade goes to the stand-in's Checkout, the
test card pays, the buyer comes back to /billing/success, Stripe's webhook (localstripe's) moves the
account to Premium and its lane, and the page says so. The stand-in is given to a stack of its own
(instant engine) with the same settings `flatfare up` gives its gateway: starting `flatfare up` itself
would start vLLM, which this test does not need. (Without it, `flatfare up` says billing is off:
tests/fleet/test_up.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psutil
import pytest

from flatfare.cli.local_payments import LocalPayments, sellable_plans
from flatfare.redis_local import free_port
from flatfare.storage.db import migrate
from tests.conftest import eventually, launch_stack, need
from tests.console.conftest import ConsoleClient, new_email

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    try:
        import localstripe  # noqa: F401
    except ImportError:
        need(False, "localstripe is not installed: pip install -e '.[test]'")
    data = tmp_path_factory.mktemp("local-payments")
    database_url = f"sqlite:///{data / 'flatfare.db'}"
    migrate(database_url)
    plans = asyncio.run(sellable_plans(database_url))
    payments = LocalPayments(plans).start(data / "localstripe.log")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    try:
        with launch_stack(data / "stack", model="instant", worker_args=("--engine", "instant"), port=port,
                          database_url=database_url, account_plan="free",
                          env={**payments.gateway_env(), "FLATFARE_PUBLIC_URL": base_url}) as stack:
            payments.configure(stack.base_url)
            yield stack, payments
    finally:
        payments.stop()


def test_a_newcomer_buys_premium_with_the_local_stand_in(local_stack, page) -> None:  # noqa: ANN001
    stack, payments = local_stack
    sold = {plan.name: plan for plan in payments.plans}
    assert {"pro", "premium"} <= set(sold), sold  # the plans' own prices, from the database
    client = ConsoleClient(stack)
    client.email = new_email("local-buyer")  # type: ignore[attr-defined]
    client.signup(client.email)  # type: ignore[attr-defined]
    page.context.add_cookies([{"name": "ff_console", "value": client.session_cookie, "url": stack.base_url}])
    page.goto(f"{stack.base_url}/console/billing")
    assert page.locator("#current-plan").get_attribute("data-plan") == "free"
    page.click("[data-buy=premium]")
    page.wait_for_url(f"{payments.edge_url}/checkout/**")
    premium = sold["premium"]
    assert f"${premium.monthly_cents / 100:,.2f}" in page.locator("#pay").inner_text()
    page.click("#pay")
    page.wait_for_url(f"{stack.base_url}/billing/success")
    page.locator("#checkout-outcome[data-state=confirmed]").wait_for(timeout=60_000)
    assert "Premium" in page.locator("#checkout-outcome").inner_text()
    plan, lane = eventually(lambda: stack.sql("SELECT a.plan, p.lane FROM accounts a JOIN plans p ON p.name = a.plan "
                                              "JOIN console_users u ON u.account_id = a.id WHERE u.email = :e",
                                              e=client.email)[0],  # type: ignore[attr-defined]
                            lambda row: row[0] == "premium", "the account on Premium")
    assert lane == "premium"
    client.close()


def test_the_stand_in_listens_on_the_loopback_only(local_stack) -> None:  # noqa: ANN001
    """localstripe takes any card: reachable from the network, it would sell plans for nothing."""
    _stack, payments = local_stack
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    for port in (payments.stripe_port, payments.edge_port):
        assert {ip for ip, p in listening if p == port} == {"127.0.0.1"}, (port, listening)
