"""The console's failed-login counters (flatfare.gateway.console.ratelimit): behind a trusted proxy each
forwarded client has its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack, eventually, free_port, stop_process
from tests.console.conftest import clear_attempts, csrf_of, new_email


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_behind_a_trusted_proxy_each_client_has_its_own_login_counter(stack: Stack, tmp_path: Path,
                                                                       server: str) -> None:
    """A gateway trusting 127.0.0.0/8 (FLATFARE_FORWARDED_ALLOW_IPS), reached from 127.0.0.2 as from a
    proxy: the failed logins of one forwarded client do not lock out another."""
    port = free_port()
    env = {**stack.env, "FLATFARE_FORWARDED_ALLOW_IPS": "127.0.0.0/8", "FLATFARE_CONSOLE_LOGIN_ATTEMPTS": "3",
           "FLATFARE_SERVER": server}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", str(port)], env=env,
                               cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

    def login(client_ip: str) -> int:
        headers = {"X-Forwarded-For": client_ip}
        fresh = httpx.Client(base_url=f"http://127.0.0.1:{port}", transport=httpx.HTTPTransport(
            local_address="127.0.0.2"), timeout=60, headers=headers)
        try:
            page = fresh.get("/console/login")
            return fresh.post("/console/login", data={"csrf_token": csrf_of(page.text), "email": new_email(),
                                                      "password": "not the password at all"}).status_code
        finally:
            fresh.close()

    try:
        def up() -> int:
            try:
                return http.get("/console/login").status_code
            except httpx.TransportError:
                return 0

        eventually(up, lambda status: status == 200, "the second gateway answering", timeout_s=120)
        clear_attempts(stack.redis_url)
        statuses = [login("203.0.113.1") for _ in range(4)]
        assert statuses[-1] == 429, statuses  # that client is locked out...
        assert login("203.0.113.2") == 401  # ...and another one, through the same proxy, is not
    finally:
        http.close()
        stop_process(gateway)
        log.close()
        clear_attempts(stack.redis_url)
