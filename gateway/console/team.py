"""The team page (``/console/team``) and invitation links (``/console/invite/{token}``): members and
their roles, invitations by email, role changes, removal (with the keys the member made revoked or
moved), leaving, and switching between the accounts one is a member of. The rules are
:mod:`.members`'; these routes parse the form, call them and show the outcome."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.exc import IntegrityError

from flatfare.gateway.console import members, users
from flatfare.gateway.console.auth import TOO_MANY, anonymous_page, client_address, limiter
from flatfare.gateway.console.deps import ConsoleCustomer, ConsoleForm, Customer, current_session, sessions_of
from flatfare.gateway.console.mail import Mailer
from flatfare.gateway.console.pages import render
from flatfare.gateway.console.ratelimit import address_subject, email_subject
from flatfare.gateway.roles import ROLES, Area, may_manage
from flatfare.gateway.app_state import services_of
from flatfare.storage.models import Account, AccountInvite, ConsoleUser

router = APIRouter(prefix="/console", include_in_schema=False)

UserId = Annotated[int, Path(ge=1, le=2**31 - 1)]
Token = Annotated[str, Path(min_length=10, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
FLASHES = {"invited": "Invitation sent. Its link works once, until it expires.",
           "role": "The member's role was changed.",
           "removed": "The member was removed.",
           "cancelled": "The invitation was cancelled: its link no longer works.",
           "switched": "You now act for this account."}


def limits(request: Request) -> members.TeamLimits:
    settings = services_of(request).settings
    return members.TeamLimits(max_members=settings.console_team_max_members,
                              invites_per_day=settings.console_team_invites_per_day,
                              invite_ttl=timedelta(seconds=settings.console_team_invite_ttl_s))


async def _page(request: Request, customer: Customer, *, status_code: int = 200, **context: Any) -> Response:
    now = datetime.now(UTC)
    manager = customer.may(Area.TEAM)
    async with services_of(request).sessions() as db:
        team = await members.members(db, customer.account.id)
        invites = await members.pending_invites(db, customer.account.id, now) if manager else []
        activity = await members.activity(db, customer.account.id) if manager else []
        mine = await members.accounts_of(db, customer.user.id)
    flash = FLASHES.get(request.query_params.get("done", ""), "")
    return render(request, "team.html", {
        "customer": customer, "team": team, "invites": invites, "activity": activity, "accounts": mine,
        "manager": manager, "roles": [r.value for r in ROLES], "flash": flash,
        "manageable": {m.user_id for m in team if m.user_id != customer.user.id
                       and may_manage(customer.role, m.role)},
        "key_holders": [m for m in team if m.role in ("owner", "admin", "developer")],
        "invite_days": round(services_of(request).settings.console_team_invite_ttl_s / 86_400, 1),
        **context}, status_code=status_code)


async def _refused(request: Request, customer: Customer, exc: members.TeamError) -> Response:
    return await _page(request, customer, error=str(exc), status_code=exc.status)


@router.get("/team")
async def team_page(request: Request, customer: ConsoleCustomer) -> Response:
    return await _page(request, customer)


@router.post("/team/invite")
async def invite(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    settings = services_of(request).settings
    try:
        email = users.normalize_email(form.get("email", "")[: users.MAX_EMAIL_LENGTH + 1])
    except users.ConsoleUserError as exc:
        return await _refused(request, customer, members.TeamError(str(exc)))
    try:
        async with services_of(request).sessions() as db, db.begin():
            row, token = await members.invite(db, customer.account.id, customer.user, customer.role, email,
                                              form.get("role", ""), limits(request), datetime.now(UTC))
    except members.TeamError as exc:
        return await _refused(request, customer, exc)
    link = settings.public_url.rstrip("/") + f"/console/invite/{token}"
    await Mailer(settings).send(email, f"Join {customer.account.name} on Flatfare",
                                f"{customer.user.email} invited you to the Flatfare account {customer.account.name} "
                                f"as {row.role}. Open this link to accept: {link}\n"
                                f"It works once, until {row.expires_at:%Y-%m-%d %H:%M} UTC. "
                                "If you did not expect it, ignore this email.")
    return RedirectResponse("/console/team?done=invited", status_code=303)


@router.post("/team/invites/{invite_id}/cancel")
async def cancel_invite(request: Request, invite_id: UserId, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    try:
        async with services_of(request).sessions() as db, db.begin():
            await members.cancel_invite(db, customer.account.id, customer.user, customer.role, invite_id,
                                        datetime.now(UTC))
    except members.TeamError as exc:
        return await _refused(request, customer, exc)
    return RedirectResponse("/console/team?done=cancelled", status_code=303)


@router.post("/team/{user_id}/role")
async def change_role(request: Request, user_id: UserId, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    try:
        async with services_of(request).sessions() as db, db.begin():
            await members.change_role(db, customer.account.id, customer.user, customer.role, user_id,
                                      form.get("role", ""))
    except members.TeamError as exc:
        return await _refused(request, customer, exc)
    return RedirectResponse("/console/team?done=role", status_code=303)


def _heir(form: dict[str, str]) -> int | None:
    """The member the keys move to (form field ``move_keys_to``); empty: the keys are revoked."""
    value = form.get("move_keys_to", "").strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 2**31 - 1:
        raise members.TeamError("Choose a member to move the keys to, or none to revoke them.")
    return int(value)


@router.post("/team/{user_id}/remove")
async def remove(request: Request, user_id: UserId, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    if user_id == customer.user.id:
        return await _refused(request, customer, members.TeamError("To leave the account, use Leave."))
    try:
        async with services_of(request).sessions() as db, db.begin():
            await members.remove(db, customer.account.id, customer.user, customer.role, user_id, _heir(form))
    except members.TeamError as exc:
        return await _refused(request, customer, exc)
    await sessions_of(request).end_all(user_id)  # they are logged out everywhere (the console checks anyway)
    return RedirectResponse("/console/team?done=removed", status_code=303)


@router.post("/team/leave")
async def leave(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    try:
        async with services_of(request).sessions() as db, db.begin():
            await members.remove(db, customer.account.id, customer.user, customer.role, customer.user.id, _heir(form))
            user = await db.get(ConsoleUser, customer.user.id)
    except members.TeamError as exc:
        return await _refused(request, customer, exc)
    if user is None or user.account_id is None:
        response = RedirectResponse("/console/login?done=left", status_code=303)
        await sessions_of(request).end(customer.session, response)
        return response
    return await _act_for(request, user, "/console?done=left", customer.session)


@router.post("/team/switch")
async def switch(request: Request, customer: ConsoleCustomer, form: ConsoleForm) -> Response:
    target = form.get("account_id", "")
    async with services_of(request).sessions() as db, db.begin():
        user = await db.get(ConsoleUser, customer.user.id, with_for_update=True)
        if (not target.isdigit() or len(target) > 10 or int(target) > 2**31 - 1
                or await members.role_of(db, user.id, int(target)) is None):
            return await _refused(request, customer, members.TeamError("You are not a member of that account.", 404))
        user.account_id = int(target)
    return await _act_for(request, user, "/console/team?done=switched", customer.session)


async def _act_for(request: Request, user: ConsoleUser, target: str, replacing: Any) -> Response:
    """A session for the user's current account (a new id: what it may open changed)."""
    response = RedirectResponse(target, status_code=303)
    await sessions_of(request).start(response, user_id=user.id, account_id=user.account_id, email=user.email,
                                     password_hash=user.password_hash, replacing=replacing)
    return response


# -- invitation links ------------------------------------------------------------------------------

async def _invite_view(request: Request, token: str) -> tuple[AccountInvite, Account, ConsoleUser | None]:
    async with services_of(request).sessions() as db:
        row = await members.open_invite(db, token, datetime.now(UTC))
        account = await db.get(Account, row.account_id)
        invitee = await users.find_user(db, row.email)
    return row, account, invitee


async def _invite_page(request: Request, token: str, *, status_code: int = 200, **context: Any) -> Response:
    try:
        row, account, invitee = await _invite_view(request, token)
    except members.TeamError as exc:
        return await anonymous_page(request, "invite.html", {"problem": str(exc)}, status_code=exc.status)
    session = await current_session(request)
    return await anonymous_page(request, "invite.html", {
        "invite": row, "account": account, "token": token, "has_user": invitee is not None,
        "signed_in_as": session.email if session is not None and session.user_id is not None else "",
        **context}, status_code=status_code)


@router.get("/invite/{token}")
async def invite_page(request: Request, token: Token) -> Response:
    return await _invite_page(request, token)


@router.post("/invite/{token}")
async def accept(request: Request, token: Token, form: ConsoleForm) -> Response:
    """Accept as the logged-in user (whose email must be the invitation's), or with the invitee's
    password (an existing user: the login's attempt limits apply), or by choosing one (a new user)."""
    settings = services_of(request).settings
    session = await current_session(request)
    password = form.get("password", "")
    now = datetime.now(UTC)
    try:
        async with services_of(request).sessions() as db:
            row = await members.open_invite(db, token, now)
    except members.TeamError as exc:
        return await anonymous_page(request, "invite.html", {"problem": str(exc)}, status_code=exc.status)
    if session is not None and session.user_id is not None and session.email == row.email:
        user_id: int | None = session.user_id
    else:
        address = client_address(request)
        subjects = (address_subject(address), email_subject(row.email, address))
        attempts = limiter(request)
        if await attempts.blocked(*subjects):
            return await _invite_page(request, token, error=TOO_MANY, status_code=429)
        async with services_of(request).sessions() as db:
            existing = await users.find_user(db, row.email)
        if existing is not None:
            user = await users.authenticate(services_of(request).sessions, row.email, password)
            if user is None:
                await attempts.failed(*subjects)
                return await _invite_page(request, token, error="That password is not right for " + row.email,
                                          status_code=401)
            user_id = user.id
        else:
            try:
                users.check_new_password(password, settings.console_min_password_length)
            except users.ConsoleUserError as exc:
                return await _invite_page(request, token, error=str(exc), status_code=400)
            user_id = None
    try:
        async with services_of(request).sessions() as db, db.begin():
            if user_id is None:
                user = await users.create_invited(db, row.email, password)
            else:
                user = await db.get(ConsoleUser, user_id, with_for_update=True)
            await members.accept(db, token, user, limits(request), now)
    except members.TeamError as exc:
        return await _invite_page(request, token, error=str(exc), status_code=exc.status)
    except IntegrityError:  # the same address signed up, or the link was taken, at the same moment
        return await _invite_page(request, token, error="This invitation was just used. Log in instead.",
                                  status_code=409)
    return await _act_for(request, user, "/console?done=joined", session)
