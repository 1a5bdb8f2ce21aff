"""Sign-up, email confirmation and password reset: the pages a visitor uses before logging in.

No answer says whether an email has an account: a reset request always answers "if it exists, we
sent a link", and with email confirmation on, a sign-up always answers "check your email" (the owner
of a taken, confirmed address gets a note instead of a link; an unconfirmed one, a fresh link).
With confirmation off a sign-up logs the new user straight in, so a taken address must be refused
there: operators who need sign-up to reveal nothing turn confirmation on. Every attempt counts against the client address's limit.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import RedirectResponse, Response

from flatfare.gateway.console import tokens, users
from flatfare.gateway.console.auth import TOO_MANY, anonymous_page, client_address, limiter
from flatfare.gateway.console.deps import ConsoleForm, current_session, sessions_of
from flatfare.gateway.console.mail import Mailer
from flatfare.gateway.console.pages import render
from flatfare.gateway.console.ratelimit import address_subject
from flatfare.storage.models import ConsoleUser
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)

Token = Annotated[str, Path(min_length=10, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
CHECK_EMAIL = "Check your email: if the address can be used, we sent a link to continue."
RESET_SENT = "If an account uses that email, we sent it a link to choose a new password. It works once, for an hour."
LINK_STALE = "This link has expired or was already used. Ask for a new one."


def _link(request: Request, path: str) -> str:
    return services_of(request).settings.public_url.rstrip("/") + path


@router.get("/signup")
async def signup_page(request: Request) -> Response:
    return await anonymous_page(request, "signup.html", {"closed": not services_of(request).settings.console_signup})


@router.post("/signup")
async def signup(request: Request, form: ConsoleForm) -> Response:
    settings = services_of(request).settings
    if not settings.console_signup:
        return render(request, "signup.html", {"closed": True}, status_code=403)
    attempts = limiter(request)
    subject = address_subject(client_address(request))
    raw_email = form.get("email", "")[: users.MAX_EMAIL_LENGTH + 1]
    if await attempts.blocked(subject):
        return render(request, "signup.html", {"error": TOO_MANY, "email": raw_email}, status_code=429)
    await attempts.failed(subject)  # every sign-up counts: it is how one would probe for addresses
    password = form.get("password", "")
    try:
        email = users.normalize_email(raw_email)
        users.check_new_password(password, settings.console_min_password_length)
    except users.ConsoleUserError as exc:
        return render(request, "signup.html", {"error": str(exc), "email": raw_email}, status_code=400)
    verify = settings.console_require_email_verification
    user = await users.create_customer(services_of(request).sessions, email, password, verified=not verify)
    mailer = Mailer(settings)
    if verify:
        if user is None:  # taken: an address never confirmed gets a fresh link (the first may be lost)
            async with services_of(request).sessions() as db:
                existing = await users.find_user(db, email)
            if existing is not None and existing.email_verified_at is None:
                user = existing
        if user is not None:
            token = await tokens.issue(services_of(request).redis, tokens.VERIFY, user.id, settings.console_link_ttl_s)
            await mailer.send(email, "Confirm your Flatfare account",
                              f"Open this link to confirm your email: {_link(request, '/console/verify/' + token)}")
        else:
            await mailer.send(email, "Your Flatfare account",
                              "Someone tried to sign up with this email, which already has an account. "
                              f"Log in at {_link(request, '/console/login')} or reset your password there.")
        return render(request, "signup.html", {"sent": CHECK_EMAIL})
    if user is None:
        return render(request, "signup.html", {"error": "That email cannot be used to sign up. If it is yours, "
                                                        "log in or reset your password.", "email": raw_email},
                      status_code=409)
    response = RedirectResponse("/console?done=welcome", status_code=303)
    await sessions_of(request).start(response, user_id=user.id, account_id=user.account_id, email=user.email,
                                     password_hash=user.password_hash, replacing=await current_session(request))
    return response


@router.get("/verify/{token}")
async def verify(request: Request, token: Token) -> Response:
    user_id = await tokens.take(services_of(request).redis, tokens.VERIFY, token)
    if user_id is None:
        return await anonymous_page(request, "login.html", {"error": LINK_STALE}, status_code=400)
    async with services_of(request).sessions() as db, db.begin():
        user = await db.get(ConsoleUser, user_id, with_for_update=True)
        if user is not None and user.email_verified_at is None:
            user.email_verified_at = datetime.now(UTC)
    return RedirectResponse("/console/login?done=verified", status_code=303)


@router.get("/reset")
async def reset_page(request: Request) -> Response:
    return await anonymous_page(request, "reset.html")


@router.post("/reset")
async def request_reset(request: Request, form: ConsoleForm) -> Response:
    settings = services_of(request).settings
    attempts = limiter(request)
    subject = address_subject(client_address(request))
    if await attempts.blocked(subject):
        return render(request, "reset.html", {"error": TOO_MANY}, status_code=429)
    await attempts.failed(subject)
    try:
        email = users.normalize_email(form.get("email", "")[: users.MAX_EMAIL_LENGTH + 1])
    except users.ConsoleUserError as exc:
        return render(request, "reset.html", {"error": str(exc)}, status_code=400)
    async with services_of(request).sessions() as db:
        user = await users.find_user(db, email)
    if user is not None:
        token = await tokens.issue(services_of(request).redis, tokens.RESET, user.id, settings.console_link_ttl_s)
        await Mailer(settings).send(email, "Reset your Flatfare password",
                                    f"Open this link to choose a new password: "
                                    f"{_link(request, '/console/reset/' + token)}\n"
                                    "If you did not ask for it, ignore this email.")
    return render(request, "reset.html", {"sent": RESET_SENT})


@router.get("/reset/{token}")
async def reset_form(request: Request, token: Token) -> Response:
    if await tokens.peek(services_of(request).redis, tokens.RESET, token) is None:
        return await anonymous_page(request, "reset.html", {"error": LINK_STALE}, status_code=400)
    return await anonymous_page(request, "reset.html", {"token": token})


@router.post("/reset/{token}")
async def reset_password(request: Request, token: Token, form: ConsoleForm) -> Response:
    settings = services_of(request).settings
    password = form.get("password", "")
    try:
        users.check_new_password(password, settings.console_min_password_length)
    except users.ConsoleUserError as exc:
        return render(request, "reset.html", {"token": token, "error": str(exc)}, status_code=400)
    user_id = await tokens.take(services_of(request).redis, tokens.RESET, token)
    if user_id is None:
        return render(request, "reset.html", {"error": LINK_STALE}, status_code=400)
    await users.set_password(services_of(request).sessions, user_id, password, verify_email=True)
    await sessions_of(request).end_all(user_id)
    return RedirectResponse("/console/login?done=reset", status_code=303)
