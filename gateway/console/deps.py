"""The console's FastAPI dependencies: who is logged in (:data:`ConsoleCustomer`, :data:`ConsoleAdmin`),
whether their role in the account opens a page (:data:`KeysMember`, :data:`UsageMember`,
:data:`BillingMember`: :mod:`flatfare.gateway.roles`' areas) and a form whose CSRF token was checked
(:data:`ConsoleForm`, :data:`CsrfChecked`).

Every POST of the console takes :data:`ConsoleForm` or :data:`CsrfChecked`: a request without the
session's token (form field ``csrf_token`` or header ``X-CSRF-Token``, which htmx sends) is refused
with 403 before the route runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qsl

from fastapi import Depends, Request
from sqlalchemy import select

from flatfare.gateway.admin.auth import Admin, Scope
from flatfare.gateway.roles import Area, areas
from flatfare.gateway.console.sessions import ConsoleSession, ConsoleSessions, stamp_matches
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.asgi import read_body
from flatfare.storage.models import Account, AccountMember, AdminToken, ConsoleUser
from flatfare.gateway.app_state import services_of

CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
# Console forms are small: an email, a password, a key's limits.
MAX_FORM_BYTES = 64 * 1024
MAX_FORM_FIELDS = 64


class LoginRequired(Exception):
    """The page needs a logged-in customer (or, with ``admin``, an admin): a browser is sent to log in."""

    def __init__(self, admin: bool = False) -> None:
        super().__init__("log in first")
        self.admin = admin


@dataclass(frozen=True, slots=True)
class Customer:
    """The logged-in console user, the account they act for and their role in it."""

    user: ConsoleUser
    account: Account
    session: ConsoleSession
    role: str

    def may(self, area: Area) -> bool:
        return area in areas(self.role)


def sessions_of(request: Request) -> ConsoleSessions:
    return services_of(request).console_sessions


async def current_session(request: Request) -> ConsoleSession | None:
    """The request's console session (read once per request), or None."""
    if not hasattr(request.state, "console_session"):
        request.state.console_session = await sessions_of(request).load(request)
    return request.state.console_session


async def console_customer(request: Request) -> Customer:
    session = await current_session(request)
    if session is None or session.user_id is None or session.account_id is None:
        raise LoginRequired()
    async with services_of(request).sessions() as db:
        user = await db.get(ConsoleUser, session.user_id)
        account = await db.get(Account, session.account_id)
        # A removed member's sessions end here, on their next request.
        member = await db.get(AccountMember, (session.account_id, session.user_id))
    if (user is None or account is None or member is None or user.account_id != account.id
            or not stamp_matches(session, user.password_hash)):  # started before a password change
        await sessions_of(request).end(session)
        raise LoginRequired()
    request.state.console_areas = areas(member.role)  # the nav shows what the role opens
    return Customer(user=user, account=account, session=session, role=member.role)


def _member_in(area: Area):  # noqa: ANN202 - a FastAPI dependency
    async def member(customer: Annotated[Customer, Depends(console_customer)]) -> Customer:
        if not customer.may(area):
            raise APIError(403, f"Your role in this account ({customer.role}) does not open this page: "
                                "ask an owner or admin of the account.", code="role_forbidden")
        return customer
    return member


async def console_admin(request: Request) -> Admin:
    """The admin behind the session: an admin token (still unrevoked, with its scopes) or a console user
    with ``is_admin`` (both scopes; ``token_id`` None, so audit entries name them by ``name`` only)."""
    session = await current_session(request)
    if session is None or not session.admin:
        raise LoginRequired(admin=True)
    async with services_of(request).sessions() as db:
        if session.admin_token_id is not None:
            token = await db.get(AdminToken, session.admin_token_id)
            if token is None or token.revoked_at is not None:
                await sessions_of(request).end(session)
                raise LoginRequired(admin=True)
            return Admin(token_id=token.id, name=token.name, scopes=frozenset(token.scopes))
        user = await db.scalar(select(ConsoleUser).where(ConsoleUser.id == session.user_id))
    if user is None or not user.is_admin or not stamp_matches(session, user.password_hash):
        await sessions_of(request).end(session)
        raise LoginRequired(admin=True)
    return Admin(token_id=None, name=f"console:{user.email}",  # type: ignore[arg-type]
                 scopes=frozenset({Scope.READ.value, Scope.WRITE.value}))


def _csrf_refused() -> APIError:
    return APIError(403, "The form's CSRF token is missing or stale: reload the page and try again.",
                    code="csrf_failed")


async def _csrf_header(request: Request) -> ConsoleSession:
    """The session, after checking the ``X-CSRF-Token`` header (JSON and htmx requests)."""
    session = await current_session(request)
    if session is None or not session.csrf_matches(request.headers.get(CSRF_HEADER)):
        raise _csrf_refused()
    return session


async def _form(request: Request) -> dict[str, str]:
    """The urlencoded form (bounded in size and fields), after checking its CSRF token."""
    session = await current_session(request)
    if session is None:
        raise _csrf_refused()
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/x-www-form-urlencoded":
        raise APIError(415, "Console forms are sent as application/x-www-form-urlencoded.",
                       code="unsupported_media_type")
    body = await read_body(request.receive, request.headers.get("content-length"), MAX_FORM_BYTES)
    try:
        form = dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS,
                              strict_parsing=False))
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, "The form could not be read.", code="invalid_form") from exc
    if any("\x00" in name or "\x00" in value for name, value in form.items()):  # PostgreSQL refuses NUL
        raise APIError(400, "A form field contains a NUL character: remove it and try again.", code="invalid_form")
    if not session.csrf_matches(request.headers.get(CSRF_HEADER) or form.get(CSRF_FIELD)):
        raise _csrf_refused()
    return form


ConsoleCustomer = Annotated[Customer, Depends(console_customer)]
KeysMember = Annotated[Customer, Depends(_member_in(Area.KEYS))]
UsageMember = Annotated[Customer, Depends(_member_in(Area.USAGE))]
BillingMember = Annotated[Customer, Depends(_member_in(Area.BILLING))]
ConsoleAdmin = Annotated[Admin, Depends(console_admin)]
ConsoleForm = Annotated[dict[str, str], Depends(_form)]
CsrfChecked = Annotated[ConsoleSession, Depends(_csrf_header)]
