"""Telling a console user that their login was locked from an address. The counters
(:mod:`.ratelimit`) lock an email only from the address that failed, so the owner can still log in;
this email says it happened, from where, and what to do if it was not them. It is sent after the answer
(a background task): the refused visitor's answer takes the same time whether or not the email has an
account, and says nothing of it."""

from __future__ import annotations

from enum import Enum

from starlette.background import BackgroundTask

from flatfare.gateway.app_state import Services
from flatfare.gateway.console import users
from flatfare.gateway.console.mail import Mailer

SUBJECT = "Your Flatfare console login was locked from one address"


class Where(Enum):
    """Which form's failures locked it."""

    LOGIN = "wrong passwords on the login page"
    PASSWORD_FORM = "wrong current passwords on the password-change form of a logged-in session"


def notice(services: Services, email: str, address: str, where: Where) -> BackgroundTask:
    """The task that emails ``email``'s user (if there is one) about the lock."""
    return BackgroundTask(_send, services, email, address, where)


async def _send(services: Services, email: str, address: str, where: Where) -> None:
    async with services.sessions() as db:
        user = await users.find_user(db, email)
    if user is None:
        return
    settings = services.settings
    minutes = max(1, round(settings.console_login_window_s / 60))
    advice = ("If this was not you, a session of yours may be in someone else's hands: reset your password from "
              "the login page (\"Forgot your password?\"), which logs out every session."
              if where is Where.PASSWORD_FORM else
              "Logins from your other addresses still work. If this was not you, someone may be guessing your "
              "password: use a long, unique one (Account page), or reset it from the login page.")
    await Mailer(settings).send(user.email, SUBJECT,
                                f"After {settings.console_login_attempts} {where.value} from the address {address}, "
                                f"logging in to the Flatfare console as {user.email} from that address is locked for "
                                f"{minutes} minutes. {advice}")
