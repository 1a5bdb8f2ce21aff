"""What the console's tests share: a real Chromium (Debian's, driven by Playwright; one per session),
an httpx client that speaks the console's forms (session cookie, CSRF token), and fresh users.

The browser is Debian's ``chromium`` package: never ``playwright install`` (it downloads a browser of
its own, which cannot work here). ``.ci/run`` installs the package.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from flatfare.gateway.console import keyspace
from tests.conftest import Stack, need, unavailable

CHROMIUM = os.environ.get("FLATFARE_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
SECRET = re.compile(r"ff-[A-Za-z0-9_-]{43}")
PASSWORD = "correct horse battery staple"
REPO = Path(__file__).resolve().parents[2]
# Set FLATFARE_TEST_SCREENSHOTS=1 to write the pages' screenshots into docs/screenshots (README shows them).
SCREENSHOTS = REPO / "docs" / "screenshots"


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def new_email(tag: str = "dev") -> str:
    return f"{tag}-{secrets.token_hex(4)}@example.com"


def clear_attempts(redis_url: str) -> None:
    """Forget the console's failed-attempt counters: every test signs up from 127.0.0.1, whose address
    limit would otherwise be spent by the tests before it."""
    client = redis_sync.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=keyspace.console_attempts_key("*", "*"), count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class ConsoleClient:
    """The console through httpx, as a browser would use it: cookies kept, the CSRF token of the last
    page sent with each form."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.http = httpx.Client(base_url=stack.base_url, timeout=60)
        self.csrf = ""

    def get(self, path: str) -> httpx.Response:
        response = self.http.get(path)
        match = CSRF.search(response.text)
        if match:
            self.csrf = match.group(1)
        return response

    def post(self, path: str, data: dict[str, str] | None = None, *, csrf: bool = True) -> httpx.Response:
        fields = dict(data or {})
        if csrf:
            fields.setdefault("csrf_token", self.csrf)
        response = self.http.post(path, data=fields)
        match = CSRF.search(response.text)
        if match:
            self.csrf = match.group(1)
        return response

    @property
    def session_cookie(self) -> str | None:
        return self.http.cookies.get("ff_console")

    def signup(self, email: str, password: str = PASSWORD) -> httpx.Response:
        clear_attempts(self.stack.redis_url)
        self.get("/console/signup")
        response = self.post("/console/signup", {"email": email, "password": password})
        assert response.status_code == 303, response.text
        self.get("/console")
        return response

    def login(self, email: str, password: str = PASSWORD) -> httpx.Response:
        self.get("/console/login")
        response = self.post("/console/login", {"email": email, "password": password})
        if response.status_code == 303:
            self.get("/console")
        return response

    def create_key(self, name: str = "test", **limits: str) -> tuple[int, str]:
        self.get("/console/keys")
        response = self.post("/console/keys", {"name": name, **limits})
        assert response.status_code == 201, response.text
        secret = SECRET.search(response.text)
        assert secret, "the new key is not on the page"
        key_id = self.stack.sql("SELECT id FROM api_keys WHERE prefix = :p", p=secret.group(0)[:11])[0][0]
        return key_id, secret.group(0)

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def console_client(stack: Stack) -> Iterator[ConsoleClient]:
    """A console client with no session yet, on the shared live stack."""
    client = ConsoleClient(stack)
    yield client
    client.close()


@pytest.fixture
def customer(stack: Stack) -> Iterator[ConsoleClient]:
    """A freshly signed-up customer's console client (``.email``)."""
    client = ConsoleClient(stack)
    client.email = new_email()  # type: ignore[attr-defined]
    client.signup(client.email)  # type: ignore[attr-defined]
    yield client
    client.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium for a test module; tests open their own context (cookies) on it.

    Module, not session: while Playwright's sync API is alive it holds an event loop running in this
    thread, so every async test or fixture after it (pytest-asyncio's) fails with "Cannot run the event
    loop while another loop is running". Launching costs about a second; keep a module's browser tests
    free of async tests and fixtures."""
    need(shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed: pip install -e '.[test]'")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser) -> Iterator[object]:  # noqa: ANN001 - a Playwright Browser
    """A fresh browser context (no cookies) and page, 1280x800."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(60_000)
    page = context.new_page()
    yield page
    context.close()


def screenshot(page, name: str, tmp_path: Path) -> Path:  # noqa: ANN001 - a Playwright Page
    """A full-page PNG of the current page: into docs/screenshots with FLATFARE_TEST_SCREENSHOTS=1."""
    folder = SCREENSHOTS if os.environ.get("FLATFARE_TEST_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
