"""The console's mail (flatfare.gateway.console.mail): without SMTP, a one-time link reaches the log only in
local mode, where the operator opens it from there."""

from __future__ import annotations

import logging

import pytest

from flatfare.gateway.console.mail import LOG_MARK, Mailer
from flatfare.gateway.settings import GatewaySettings


async def test_without_smtp_outside_local_mode_no_link_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    link = "https://console.example.com/console/reset/abcdefghijklmnop"
    caplog.set_level(logging.WARNING, logger="flatfare.console")
    await Mailer(GatewaySettings.model_construct(smtp_host="", local_mode=False)).send(
        "Victim@Example.com", "Reset your Flatfare password", f"Open this link: {link}")
    text = caplog.text
    assert "SMTP not configured" in text
    assert link not in text and "abcdefghijklmnop" not in text
    assert "victim@example.com" not in text.lower() and LOG_MARK not in text
    caplog.clear()
    await Mailer(GatewaySettings.model_construct(smtp_host="", local_mode=True)).send(
        "dev@example.com", "Reset your Flatfare password", f"Open this link: {link}")
    assert link in caplog.text and LOG_MARK in caplog.text  # local mode: the operator opens it from the log
