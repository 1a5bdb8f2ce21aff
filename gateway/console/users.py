"""Console users: sign-up (an account on the Free plan through the account services), password checks,
password changes. Emails are stored lower-cased, so uniqueness is case-insensitive everywhere."""

from __future__ import annotations

from datetime import UTC, datetime

from email_validator import EmailNotValidError, validate_email
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.gateway.console.passwords import MAX_PASSWORD_LENGTH, hash_password, verify_password
from flatfare.billing.plan_change import ensure_account
from flatfare.gateway.console.members import add_member
from flatfare.storage.models import Account, ConsoleUser, MemberRole

FREE_PLAN = "free"
MAX_EMAIL_LENGTH = 254


class ConsoleUserError(Exception):
    """A console user operation was refused; the message says why, in words a user can act on."""


def normalize_email(email: str) -> str:
    """The address, checked for shape (no DNS lookup) and lower-cased; ConsoleUserError if it is not one."""
    email = email.strip()
    if not email or len(email) > MAX_EMAIL_LENGTH:
        raise ConsoleUserError("Enter a valid email address.")
    try:
        checked = validate_email(email, check_deliverability=False)
    except EmailNotValidError as exc:
        raise ConsoleUserError("Enter a valid email address.") from exc
    return checked.normalized.lower()


def check_new_password(password: str, min_length: int) -> None:
    if len(password) < min_length:
        raise ConsoleUserError(f"Use a password of at least {min_length} characters.")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise ConsoleUserError(f"Use a password of at most {MAX_PASSWORD_LENGTH} characters.")


async def find_user(session: AsyncSession, email: str) -> ConsoleUser | None:
    return await session.scalar(select(ConsoleUser).where(ConsoleUser.email == email.lower()))


async def create_customer(sessions: async_sessionmaker[AsyncSession], email: str, password: str, *,
                          verified: bool) -> ConsoleUser | None:
    """A new user with a new account (named after the email, on Free, made by
    :func:`flatfare.billing.plan_change.ensure_account`), which they own; None when the email, or an
    account of that name, is taken (the caller must not say which)."""
    password_hash = await hash_password(password)
    async with sessions() as session:
        taken = await session.scalar(select(func.count()).select_from(Account).where(Account.name == email))
        if taken or await find_user(session, email) is not None:
            return None
        try:
            account = await ensure_account(session, email, FREE_PLAN)
            user = ConsoleUser(email=email, password_hash=password_hash, account_id=account.id, is_admin=False,
                               email_verified_at=datetime.now(UTC) if verified else None)
            session.add(user)
            await session.flush()
            await add_member(session, account.id, user.id, MemberRole.OWNER.value)
            await session.commit()
        except IntegrityError:  # the same email signed up at the same moment
            await session.rollback()
            return None
        await session.refresh(user)
        return user


async def create_user(session: AsyncSession, email: str, password: str, *, account_id: int | None = None,
                      is_admin: bool = False) -> ConsoleUser:
    """A user made by an operator (invite-only consoles, admin users): verified, an owner of
    ``account_id`` if given, not committed."""
    user = ConsoleUser(email=normalize_email(email), password_hash=await hash_password(password),
                       account_id=account_id, is_admin=is_admin, email_verified_at=datetime.now(UTC))
    session.add(user)
    await session.flush()
    if account_id is not None:
        await add_member(session, account_id, user.id, MemberRole.OWNER.value)
    return user


async def create_invited(session: AsyncSession, email: str, password: str) -> ConsoleUser:
    """A user signing up through an invitation's link (which proves the mailbox: verified), with no
    account yet: accepting the invitation gives them one. Not committed."""
    user = ConsoleUser(email=email, password_hash=await hash_password(password), account_id=None, is_admin=False,
                       email_verified_at=datetime.now(UTC))
    session.add(user)
    await session.flush()
    return user


async def authenticate(sessions: async_sessionmaker[AsyncSession], email: str, password: str) -> ConsoleUser | None:
    """The user whose email and password these are, or None; the same cost whether or not the email
    exists (a decoy hash is checked)."""
    async with sessions() as session:
        user = await find_user(session, email)
    if not await verify_password(user.password_hash if user else None, password[:MAX_PASSWORD_LENGTH + 1]):
        return None
    return user


async def set_password(sessions: async_sessionmaker[AsyncSession], user_id: int, password: str, *,
                       verify_email: bool = False) -> ConsoleUser:
    """The new password's hash stored (and, for a reset link, which proves the mailbox, the email
    marked verified); the user after the change."""
    password_hash = await hash_password(password)
    async with sessions() as session, session.begin():
        user = await session.get(ConsoleUser, user_id, with_for_update=True)
        if user is None:
            raise ConsoleUserError("That user no longer exists.")
        user.password_hash = password_hash
        if verify_email and user.email_verified_at is None:
            user.email_verified_at = datetime.now(UTC)
    return user
