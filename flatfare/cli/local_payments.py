"""``flatfare up --payments local``: a Stripe stand-in on this machine, so a newcomer can buy a plan in
the console and watch it change, with no Stripe account and nothing charged.

Two parts. localstripe (a test dependency: ``pip install localstripe``) keeps customers, prices and
subscriptions and sends signed webhooks; it lacks Checkout and the customer portal, so a small edge in
front of it (:class:`LocalPayments`, aiohttp in a thread of ``flatfare up``) answers those: a Checkout
session's URL is a page of the edge's own ("Pay with a test card"), whose button subscribes the
customer in localstripe to the plan's price (localstripe then sends ``customer.subscription.created``
to the gateway, which changes the plan) and sends the buyer back to ``/billing/success``. Everything
else is forwarded to localstripe. The gateway is pointed at the edge through its ordinary Stripe
settings (:meth:`LocalPayments.gateway_env`), so the gateway runs exactly the code it runs with Stripe.

Only plans with a monthly price and no per-request price are offered (localstripe has no Billing Meters).
"""

from __future__ import annotations

import asyncio
import html
import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx

from flatfare.redis_local import free_port

API_KEY = "sk_test_flatfare_local"
PRODUCT = "prod_flatfare_local"
TEST_CARD = {"type": "card", "card[number]": "4242424242424242", "card[exp_month]": "12", "card[exp_year]": "2040",
             "card[cvc]": "123"}
START_TIMEOUT_S = 30.0


_SERVE_LOCALSTRIPE = ("import sys; from aiohttp import web; from localstripe.server import app; "
                      "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None)")


class LocalPaymentsError(RuntimeError):
    """The stand-in could not start (localstripe missing, or not answering)."""


@dataclass(frozen=True, slots=True)
class LocalPlan:
    """A plan the stand-in sells: its name, display name and monthly price."""

    name: str
    display_name: str
    monthly_cents: int

    @property
    def price_id(self) -> str:
        return f"price_local_{self.name}"


@dataclass
class _Checkout:
    customer: str
    price: str
    success_url: str
    cancel_url: str
    paid: bool = False


@dataclass
class LocalPayments:
    """localstripe and the edge in front of it; :meth:`start`, then :meth:`configure` once the gateway's
    address is known, :meth:`stop` at the end."""

    plans: list[LocalPlan]
    edge_port: int = field(default_factory=free_port)
    stripe_port: int = field(default_factory=free_port)
    webhook_secret: str = field(default_factory=lambda: "whsec_" + secrets.token_urlsafe(24))
    _process: subprocess.Popen[bytes] | None = None
    _checkouts: dict[str, _Checkout] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: Any = None

    @property
    def edge_url(self) -> str:
        return f"http://127.0.0.1:{self.edge_port}"

    @property
    def stripe_url(self) -> str:
        return f"http://127.0.0.1:{self.stripe_port}"

    def gateway_env(self) -> dict[str, str]:
        """The gateway's Stripe settings, pointing at the edge."""
        return {"FLATFARE_STRIPE_API_KEY": API_KEY, "FLATFARE_STRIPE_WEBHOOK_SECRET": self.webhook_secret,
                "FLATFARE_STRIPE_API_BASE": self.edge_url,
                "FLATFARE_STRIPE_PRICES": json.dumps({plan.name: plan.price_id for plan in self.plans})}

    def start(self, log_path: Path | None = None) -> LocalPayments:
        try:
            import localstripe  # noqa: F401
            from aiohttp import web
        except ImportError as exc:
            raise LocalPaymentsError("--payments local needs localstripe: pip install localstripe") from exc
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        # localstripe's own entry point listens on every interface (and accepts any card): anyone who
        # reaches this host could buy plans for nothing. Its app, served on the loopback only, from scratch.
        self._process = subprocess.Popen([sys.executable, "-c", _SERVE_LOCALSTRIPE, str(self.stripe_port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                httpx.get(f"{self.stripe_url}/v1/customers", headers=self._auth, timeout=2)
                break
            except httpx.TransportError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise LocalPaymentsError(f"localstripe did not start (port {self.stripe_port})") from None
                time.sleep(0.2)
        with httpx.Client(base_url=self.stripe_url, headers=self._auth, timeout=10) as stripe:
            stripe.post("/v1/products", data={"id": PRODUCT, "name": "Flatfare", "type": "service"})
            for plan in self.plans:
                stripe.post("/v1/plans", data={"id": plan.price_id, "product": PRODUCT, "amount": plan.monthly_cents,
                                               "currency": "usd", "interval": "month", "nickname": plan.name})
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="local-payments", daemon=True).start()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)

        async def serve() -> None:
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.edge_port).start()

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(10)
        return self

    def configure(self, gateway_url: str) -> None:
        """Send localstripe's webhooks to the gateway, signed with the secret the gateway was given."""
        with httpx.Client(base_url=self.stripe_url, headers=self._auth, timeout=10) as stripe:
            answer = stripe.post("/_config/webhooks/flatfare", data={
                "url": f"{gateway_url}/billing/stripe/webhook", "secret": self.webhook_secret})
            answer.raise_for_status()

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        path = request.path
        if path == "/v1/checkout/sessions" and request.method == "POST":
            form = dict(await request.post())
            session_id = "cs_local_" + secrets.token_urlsafe(12)
            self._checkouts[session_id] = _Checkout(customer=form.get("customer", ""),
                                                    price=form.get("line_items[0][price]", ""),
                                                    success_url=form.get("success_url", ""),
                                                    cancel_url=form.get("cancel_url", ""))
            return web.json_response({"id": session_id, "object": "checkout.session", "mode": "subscription",
                                      "url": f"{self.edge_url}/checkout/{session_id}"})
        if path == "/v1/billing_portal/sessions" and request.method == "POST":
            form = dict(await request.post())
            return web.json_response({"id": "bps_local", "object": "billing_portal.session",
                                      "url": f"{self.edge_url}/portal?{urlencode({'return': form.get('return_url', '')})}"})
        if path.startswith("/checkout/"):
            return await self._checkout_page(request, path.removeprefix("/checkout/").split("/")[0])
        if path == "/portal":
            back = html.escape(request.query.get("return", ""))
            return _page("Billing portal (local)", "<p>The local Stripe stand-in has no customer portal: plans "
                         f"change through Checkout here.</p><p><a href=\"{back}\">Back to the console</a></p>")
        return await self._forward(request)

    async def _checkout_page(self, request: Any, session_id: str) -> Any:
        from aiohttp import web

        checkout = self._checkouts.get(session_id)
        if checkout is None:
            return _page("Checkout not found", "<p>This checkout session is unknown (the stand-in forgets them "
                         "when it stops). Start again from the console.</p>", status=404)
        plan = next((p for p in self.plans if p.price_id == checkout.price), None)
        if request.method == "POST":
            if not checkout.paid:
                await self._subscribe(checkout)
                checkout.paid = True
            raise web.HTTPSeeOther(checkout.success_url)
        if plan is None:
            return _page("Checkout", "<p>This price is not sold here.</p>", status=400)
        price = f"${plan.monthly_cents / 100:,.2f}"
        return _page(f"Subscribe to {html.escape(plan.display_name)}",
                     f"<p>{html.escape(plan.display_name)}: <strong>{price} a month</strong>.</p>"
                     "<p class=note>Local Stripe stand-in (<code>flatfare up --payments local</code>): a test card "
                     "is used and nothing is charged.</p>"
                     f"<form method=post action=\"/checkout/{session_id}\"><button id=pay type=submit>"
                     f"Pay {price} with a test card</button></form>"
                     f"<p><a id=cancel href=\"{html.escape(checkout.cancel_url)}\">Cancel and go back</a></p>")

    async def _subscribe(self, checkout: _Checkout) -> None:
        """What Stripe does when the buyer pays: the card becomes the customer's, the subscription starts
        (localstripe then sends its webhook to the gateway)."""
        async with httpx.AsyncClient(base_url=self.stripe_url, headers=self._auth, timeout=30) as stripe:
            card = (await stripe.post("/v1/payment_methods", data=TEST_CARD)).json()
            await stripe.post(f"/v1/payment_methods/{card['id']}/attach", data={"customer": checkout.customer})
            await stripe.post(f"/v1/customers/{checkout.customer}",
                              data={"invoice_settings[default_payment_method]": card["id"]})
            made = await stripe.post("/v1/subscriptions", data={"customer": checkout.customer,
                                                                 "items[0][plan]": checkout.price})
            made.raise_for_status()

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        async with httpx.AsyncClient(timeout=30) as client:
            upstream = await client.request(request.method, f"{self.stripe_url}{request.path_qs}",
                                            content=await request.read(), headers=dict(request.headers))
        return web.Response(body=upstream.content, status=upstream.status_code, content_type="application/json")


def _page(title: str, body: str, status: int = 200) -> Any:
    from aiohttp import web

    style = ("body{font-family:system-ui,sans-serif;max-width:28rem;margin:4rem auto;padding:0 1rem;color:#111827}"
             "button{background:#4f46e5;color:#fff;border:0;border-radius:8px;padding:.7rem 1.1rem;font:inherit;"
             "cursor:pointer}.note{color:#6b7280;font-size:.9rem}")
    return web.Response(text=f"<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport "
                             f"content=\"width=device-width, initial-scale=1\"><title>{title}</title><style>{style}"
                             f"</style></head><body><h1>{title}</h1>{body}</body></html>",
                        status=status, content_type="text/html")


async def sellable_plans(database_url: str) -> list[LocalPlan]:
    """The plans the stand-in sells: not retired, a monthly price, no per-request price."""
    from sqlalchemy import select

    from flatfare.storage.db import one_session
    from flatfare.storage.models import Plan

    async with one_session(database_url) as session:
        rows = await session.scalars(select(Plan).where(Plan.retired.is_(False), Plan.monthly_price_cents > 0,
                                                        Plan.price_per_request_micros == 0).order_by(Plan.name))
        return [LocalPlan(row.name, row.display_name, row.monthly_price_cents) for row in rows]
