"""Logging in and out: a customer by email and password, an admin by admin token (or an admin user)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from flatfare.gateway.console import lockout, users
from flatfare.gateway.console.deps import ConsoleForm, current_session, sessions_of
from flatfare.gateway.console.pages import render
from flatfare.gateway.console.ratelimit import AttemptLimiter, address_subject, email_subject
from flatfare.gateway.errors import APIError
from flatfare.storage.keys import ADMIN_PREFIX, looks_like_key
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)

LOGIN_FAILED = "That email and password do not match an account."
ADMIN_FAILED = "That admin token is not valid."
TOO_MANY = "Too many failed attempts. Wait a few minutes and try again."
NO_ACCOUNT = "You are no longer a member of any account. Ask an account's owner for a new invitation."


def limiter(request: Request) -> AttemptLimiter:
    settings = services_of(request).settings
    return AttemptLimiter(services_of(request).redis, settings.console_login_attempts, settings.console_login_window_s)


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def anonymous_page(request: Request, name: str, context: dict | None = None, *,
                         status_code: int = 200) -> Response:
    """A page for visitors not logged in: it gets a session (for its form's CSRF token) if it has none."""
    session = await current_session(request)
    if session is None:
        placeholder = Response()
        request.state.console_session = await sessions_of(request).start(placeholder)
        response = render(request, name, context, status_code=status_code)
        response.headers.append("set-cookie", placeholder.headers["set-cookie"])
        return response
    return render(request, name, context, status_code=status_code)


@router.get("/login")
async def login_page(request: Request, admin: bool = False) -> Response:
    session = await current_session(request)
    if session is not None and session.logged_in:
        return RedirectResponse("/console/admin" if session.admin and session.account_id is None else "/console",
                                status_code=303)
    done = {"verified": "Your email is confirmed. Log in to continue.",
            "reset": "Your password was changed. Log in with the new one.",
            "left": "You left the account."}.get(request.query_params.get("done", ""))
    return await anonymous_page(request, "login.html", {"admin_tab": admin, "flash": done})


@router.post("/login")
async def login(request: Request, form: ConsoleForm) -> Response:
    if form.get("mode") == "admin":
        return await _admin_login(request, form.get("admin_token", "").strip())
    email = form.get("email", "").strip().lower()[: users.MAX_EMAIL_LENGTH]
    address = client_address(request)
    subjects = (address_subject(address), email_subject(email, address))
    attempts = limiter(request)
    if await attempts.blocked(*subjects):
        return render(request, "login.html", {"error": TOO_MANY, "email": email}, status_code=429)
    user = await users.authenticate(services_of(request).sessions, email, form.get("password", ""))
    if user is None:
        _, email_locked = await attempts.failed(*subjects)
        response = render(request, "login.html", {"error": LOGIN_FAILED, "email": email}, status_code=401)
        if email_locked:
            response.background = lockout.notice(services_of(request), email, address, lockout.Where.LOGIN)
        return response
    if services_of(request).settings.console_require_email_verification and user.email_verified_at is None:
        return render(request, "login.html", {"error": "Confirm your email first: open the link we sent you.",
                                              "email": email}, status_code=403)
    await attempts.clear(subjects[1])
    if user.account_id is None and not user.is_admin:  # removed from every account they were in
        return render(request, "login.html", {"error": NO_ACCOUNT, "email": email}, status_code=403)
    response = RedirectResponse("/console/admin" if user.is_admin and user.account_id is None else "/console",
                                status_code=303)
    await sessions_of(request).start(response, user_id=user.id, account_id=user.account_id, email=user.email,
                                     admin=user.is_admin, password_hash=user.password_hash, replacing=await current_session(request))
    return response


async def _admin_login(request: Request, token: str) -> Response:
    subjects = (address_subject(client_address(request)),)
    attempts = limiter(request)
    context = {"admin_tab": True}
    if await attempts.blocked(*subjects):
        return render(request, "login.html", {**context, "error": TOO_MANY}, status_code=429)
    admin = None
    if looks_like_key(token, ADMIN_PREFIX):
        try:  # the admin API's own check: a SHA-256 lookup, then a constant-time compare
            admin = await services_of(request).admin_auth.authenticate(f"Bearer {token}")
        except APIError:
            admin = None
    if admin is None:
        await attempts.failed(*subjects)
        return render(request, "login.html", {**context, "error": ADMIN_FAILED}, status_code=401)
    response = RedirectResponse("/console/admin", status_code=303)
    await sessions_of(request).start(response, admin=True, admin_token_id=admin.token_id, admin_name=admin.name,
                                     replacing=await current_session(request))
    return response


@router.post("/logout")
async def logout(request: Request, form: ConsoleForm) -> Response:
    response = RedirectResponse("/console/login", status_code=303)
    session = await current_session(request)
    if session is not None:
        await sessions_of(request).end(session, response)
    return response
