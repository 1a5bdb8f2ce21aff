"""Every customer page of the console renders (flatfare.gateway.console.pages' ``render``, through each page's
route) for a customer who just signed up, and a failure of ours is a console page for a browser and
OpenAI's JSON for anyone else, in one gateway process (tests/gateway/rig.py). What the pages show, in a
real browser on the shared stack: tests/console/test_customer_journey.py and its neighbours."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from flatfare.gateway.console import quickstart

from tests.console.conftest import CSRF, PASSWORD, new_email
from tests.gateway.rig import Gateway, in_process_gateway


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path, local_mode=True) as gateway:
        yield gateway


async def test_every_customer_page_renders(gateway: Gateway) -> None:
    client = gateway.client
    page = await client.get("/console/signup")
    signed_up = await client.post("/console/signup", data={"email": new_email(), "password": PASSWORD,
                                                           "csrf_token": CSRF.search(page.text).group(1)})
    assert signed_up.status_code == 303, signed_up.text
    for path in ("/console", "/console/keys", "/console/usage", "/console/usage.csv", "/console/account",
                 "/console/playground", "/console/quickstart", "/console/billing"):
        page = await client.get(path)
        assert page.status_code == 200, (path, page.text[:300])


async def test_a_failure_of_ours_is_a_console_page_for_a_browser_and_json_for_the_api(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    client = gateway.client
    page = await client.get("/console/signup")
    signed_up = await client.post("/console/signup", data={"email": new_email(), "password": PASSWORD,
                                                           "csrf_token": CSRF.search(page.text).group(1)})
    assert signed_up.status_code == 303, signed_up.text

    def broken(base_url: str, model: str) -> dict[str, str]:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(quickstart, "snippets", broken)
    # A client that sees the answer Starlette sends before it re-raises the exception (for its log).
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app, raise_app_exceptions=False),
                                 base_url="http://gateway", cookies=client.cookies) as own:
        browser = await own.get("/console/quickstart", headers={"Accept": "text/html,*/*;q=0.8"})
        assert browser.status_code == 500 and browser.headers["content-type"].startswith("text/html")
        assert 'id="error-page"' in browser.text and 'href="/console"' in browser.text
        assert "a bug of ours" not in browser.text  # the exception is for the log, not the page
        script = await own.get("/console/quickstart")
        assert script.status_code == 500 and script.json()["error"]["code"] == "internal_error"
