"""Emails the console sends (password reset, address confirmation). With no SMTP host configured the
message is written to the gateway's log instead in local mode, clearly marked, so a local operator can open
the link; outside local mode only a note that it was not sent (no link: a log reader could use it)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import smtplib
from email.message import EmailMessage

from flatfare.gateway.settings import GatewaySettings

log = logging.getLogger("flatfare.console")
# The mark a reader (or `flatfare up`) looks for in the gateway's log.
LOG_MARK = "CONSOLE EMAIL (no SMTP configured)"


def _address_hash(address: str) -> str:
    """An address as the log names it: enough to match reports, not the address itself."""
    return hashlib.sha256(address.lower().encode()).hexdigest()[:16]


class MailError(Exception):
    """The mail server could not be reached or refused the message."""


class Mailer:
    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings

    async def send(self, to: str, subject: str, text: str, *, raise_errors: bool = False) -> None:
        """Send (or, without SMTP, log) one email. ``raise_errors``: an SMTP failure is raised as
        :class:`MailError` (for a caller that retries), not only logged."""
        settings = self._settings
        if not settings.smtp_host:
            if settings.local_mode:  # a local operator opens the link from the log
                log.warning("%s to=%s subject=%r: %s", LOG_MARK, to, subject, text)
            else:  # the body holds a one-time link: a log reader must not be able to use it
                log.warning("SMTP not configured, email to %s not sent (subject %r)", _address_hash(to), subject)
            return
        message = EmailMessage()
        message["From"] = settings.smtp_from
        message["To"] = to
        message["Subject"] = subject
        message.set_content(text)
        try:
            await asyncio.to_thread(self._deliver, message)
        except (OSError, smtplib.SMTPException):
            # Logged without the body: it holds a one-time link.
            log.exception("could not send a console email to %s through %s:%s", to, settings.smtp_host,
                          settings.smtp_port)
            if raise_errors:
                raise MailError(f"the mail server {settings.smtp_host}:{settings.smtp_port} did not take it") from None

    def _deliver(self, message: EmailMessage) -> None:
        settings = self._settings
        with smtplib.SMTP(settings.smtp_host, settings.smtp_port, timeout=20) as smtp:
            if settings.smtp_starttls:
                smtp.starttls()
            if settings.smtp_user:
                smtp.login(settings.smtp_user, settings.smtp_password.get_secret_value())
            smtp.send_message(message)
