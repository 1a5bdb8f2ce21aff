"""The plain rules of quota alerts (flatfare.gateway.quota_alerts), without a stack: thresholds as typed, the
webhook signature (Stripe's scheme), and which webhook URLs are refused, with a resolver that answers what
the test says a name resolves to."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from aiohttp import web

from flatfare.gateway.openai import media
from flatfare.gateway.quota_alerts import (AlertRules, AlertSettingsError, QuotaAlerts, check_webhook_url,
                                           parse_thresholds, pinned, sign)
from flatfare.storage.models import QuotaAlertDelivery
from flatfare.gateway.settings import GatewaySettings

SETTINGS = GatewaySettings.model_construct(quota_alerts_webhook_allow_http=False, quota_alerts_webhook_allow_hosts=[])


def test_thresholds_are_whole_percents_from_1_to_100() -> None:
    assert parse_thresholds("100, 80%, 80") == (80, 100)
    assert parse_thresholds("") == ()
    for typed in ("0", "101", "eighty", "1,2,3,4,5,6"):
        with pytest.raises(AlertSettingsError):
            parse_thresholds(typed)


def test_the_signature_is_an_hmac_of_timestamp_dot_body() -> None:
    body = b'{"id":"qa_1"}'
    expected = hmac.new(b"whsec_x", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign("whsec_x", 1700000000, body) == f"t=1700000000,v1={expected}"
    assert sign("whsec_y", 1700000000, body) != sign("whsec_x", 1700000000, body)


def _resolving_to(*addresses: str):  # noqa: ANN202 - a resolver
    async def resolve(host: str) -> list[str]:
        return list(addresses)
    return resolve


async def test_a_webhook_must_be_https_on_a_public_address() -> None:
    await check_webhook_url("https://hooks.example.com/flatfare", SETTINGS, _resolving_to("93.184.216.34"))
    refused = {"http://hooks.example.com/x": "https://",
               "https://10.1.2.3/x": "not a public address",
               "https://[::ffff:127.0.0.1]/x": "not a public address",
               "https://localhost/x": "not a public name",
               "https://user@hooks.example.com/x": "user info"}
    for url, why in refused.items():
        with pytest.raises(AlertSettingsError, match=why):
            await check_webhook_url(url, SETTINGS, _resolving_to("93.184.216.34"))
    # A public-looking name that resolves inside the network is refused too.
    with pytest.raises(AlertSettingsError, match="resolves to 192.168.0.5"):
        await check_webhook_url("https://hooks.example.com/x", SETTINGS, _resolving_to("93.184.216.34", "192.168.0.5"))


async def test_the_operator_may_allow_http_and_exempt_hosts_for_tests() -> None:
    settings = GatewaySettings.model_construct(quota_alerts_webhook_allow_http=True,
                                               quota_alerts_webhook_allow_hosts=["127.0.0.1"])
    await check_webhook_url("http://127.0.0.1:8080/hook", settings)
    with pytest.raises(AlertSettingsError, match="not a public address"):
        await check_webhook_url("http://127.0.0.2:8080/hook", settings)


async def test_a_malformed_url_is_a_form_error_not_a_crash() -> None:
    for url in ("https://[::1/x", "https://host:99999/x", "https:///x", "https://exa mple.com/", "\x00"):
        with pytest.raises(AlertSettingsError):
            await check_webhook_url(url, SETTINGS, _resolving_to("93.184.216.34"))


def test_a_try_is_pinned_to_the_vetted_address_with_the_name_for_host_and_tls() -> None:
    assert pinned("https://hooks.example.com/x?y=1", "93.184.216.34") == (
        "https://93.184.216.34/x?y=1", {"Host": "hooks.example.com"}, {"sni_hostname": "hooks.example.com"})
    assert pinned("https://hooks.example.com:8443/x", "2606:4700::1111") == (
        "https://[2606:4700::1111]:8443/x", {"Host": "hooks.example.com:8443"}, {"sni_hostname": "hooks.example.com"})
    assert pinned("https://hooks.example.com/x", None) == ("https://hooks.example.com/x", {}, {})


async def test_a_webhook_goes_to_the_address_vetted_never_to_a_second_resolution(monkeypatch) -> None:
    """DNS rebinding: a name that resolves to a public address for the check and inside the network a moment
    later. The try connects to what the check vetted. Here the name resolves to a receiver on loopback (which
    the test lets pass as public) only through the check's resolver: a second resolution cannot reach it."""
    received: list[tuple[str, bytes]] = []

    async def hook(request: web.Request) -> web.Response:
        received.append((request.headers["Host"], await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    monkeypatch.setattr(media, "forbidden", lambda address: str(address) != "127.0.0.1")
    settings = GatewaySettings.model_construct(quota_alerts_webhook_allow_http=True,
                                               quota_alerts_webhook_allow_hosts=[])
    alerts = QuotaAlerts(None, None, None, settings, resolver=_resolving_to("127.0.0.1"))  # type: ignore[arg-type]
    delivery = QuotaAlertDelivery(id=7, account_id=1, quota_day="2026-12-07", threshold=80, used=48, daily_limit=60)
    try:
        rules = AlertRules(webhook_url=f"http://hooks.example.com:{port}/hook", webhook_secret="whsec_x")
        await alerts._post(delivery, rules)
    finally:
        await runner.cleanup()
    assert [host for host, _ in received] == [f"hooks.example.com:{port}"]
    assert b'"threshold_percent":80' in received[0][1]
