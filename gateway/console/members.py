"""An account's team: members and their roles, emailed invitations, removal and leaving. Plain functions
on a database session (the caller's transaction); each writes its audit entry in that transaction, under
the account (``audit_log.account_id``), so the team's activity commits with the change or not at all.

Rules kept here, whichever page asks: an account keeps at least one owner (the last one can neither
leave, nor be removed or demoted); only an owner touches owners (:func:`roles.may_manage`); removing a
member revokes the keys they made unless the remover moves them to another member; an invitation's
link works once and until it expires, and only its SHA-256 is stored.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.gateway import roles
from flatfare.storage.accounts import revoke
from flatfare.storage.audit import Actor, record, snapshot
from flatfare.storage.models import (Account, AccountInvite, AccountMember, ApiKey, AuditEntry, ConsoleUser,
                                     MemberRole)

# A link's token: 256 random bits, URL-safe (43 characters).
TOKEN_LENGTH = 43


class TeamError(Exception):
    """A team change was refused; the message says why, in words a member can act on."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class TeamLimits:
    """The bounds on a team (GatewaySettings' ``console_team_*``)."""

    max_members: int
    invites_per_day: int
    invite_ttl: timedelta


@dataclass(frozen=True, slots=True)
class Member:
    user_id: int
    email: str
    role: str
    since: datetime


def actor_of(user: ConsoleUser) -> Actor:
    """How the audit log names a console member (as it names a customer's own plan changes)."""
    return Actor(None, f"console:{user.email}")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def role_of(db: AsyncSession, user_id: int, account_id: int) -> str | None:
    """The user's role in the account, or None when they are not a member."""
    return await db.scalar(select(AccountMember.role).where(AccountMember.user_id == user_id,
                                                            AccountMember.account_id == account_id))


async def members(db: AsyncSession, account_id: int) -> list[Member]:
    """The account's members, owners first, then by when they joined."""
    order = {role.value: i for i, role in enumerate(roles.ROLES)}
    rows = await db.execute(select(AccountMember, ConsoleUser.email).join(ConsoleUser, ConsoleUser.id ==
                                                                          AccountMember.user_id)
                            .where(AccountMember.account_id == account_id))
    found = [Member(m.user_id, email, m.role, m.created_at) for m, email in rows]
    return sorted(found, key=lambda m: (order.get(m.role, 99), m.since, m.user_id))


async def accounts_of(db: AsyncSession, user_id: int) -> list[tuple[Account, str]]:
    """Every account the user is a member of, with their role there."""
    rows = await db.execute(select(Account, AccountMember.role).join(AccountMember, AccountMember.account_id ==
                                                                     Account.id)
                            .where(AccountMember.user_id == user_id).order_by(Account.name))
    return [(account, role) for account, role in rows]


async def pending_invites(db: AsyncSession, account_id: int, now: datetime) -> list[AccountInvite]:
    return list(await db.scalars(select(AccountInvite).where(
        AccountInvite.account_id == account_id, AccountInvite.accepted_at.is_(None),
        AccountInvite.expires_at > now).order_by(AccountInvite.id.desc())))


async def _lock_account(db: AsyncSession, account_id: int) -> Account:
    """The account row, locked: team changes of one account run one at a time (the last-owner rule)."""
    account = await db.get(Account, account_id, with_for_update=True)
    if account is None:
        raise TeamError("That account no longer exists.", 404)
    return account


async def _owners(db: AsyncSession, account_id: int) -> int:
    return await db.scalar(select(func.count()).select_from(AccountMember).where(
        AccountMember.account_id == account_id, AccountMember.role == MemberRole.OWNER.value)) or 0


async def _membership(db: AsyncSession, account_id: int, user_id: int) -> AccountMember:
    member = await db.get(AccountMember, (account_id, user_id))
    if member is None:
        raise TeamError("That person is not a member of this account.", 404)
    return member


def _check_role(role: str) -> str:
    if role not in {r.value for r in roles.ROLES}:
        raise TeamError("Choose a role: owner, admin, developer or billing.")
    return role


async def add_member(db: AsyncSession, account_id: int, user_id: int, role: str) -> AccountMember:
    """A membership, not audited: an account's first owner (sign-up, the CLI)."""
    member = AccountMember(account_id=account_id, user_id=user_id, role=role, created_at=datetime.now(UTC))
    db.add(member)
    await db.flush()
    return member


async def invite(db: AsyncSession, account_id: int, inviter: ConsoleUser, inviter_role: str, email: str, role: str,
                 limits: TeamLimits, now: datetime) -> tuple[AccountInvite, str]:
    """An invitation for ``email`` (normalised by the caller) to join as ``role``; its link's token,
    returned here and stored only as a hash."""
    _check_role(role)
    if not roles.may_manage(inviter_role, role):
        raise TeamError("Only an owner can invite an owner." if roles.may(inviter_role, roles.Area.TEAM)
                        else "Only owners and admins can invite members.", 403)
    await _lock_account(db, account_id)
    if await db.scalar(select(AccountMember.user_id).join(ConsoleUser, ConsoleUser.id == AccountMember.user_id)
                       .where(AccountMember.account_id == account_id, ConsoleUser.email == email)) is not None:
        raise TeamError(f"{email} is already a member of this account.", 409)
    if any(pending.email == email for pending in await pending_invites(db, account_id, now)):
        raise TeamError(f"{email} has a pending invitation: cancel it to send a new one.", 409)
    sent_today = await db.scalar(select(func.count()).select_from(AccountInvite).where(
        AccountInvite.account_id == account_id, AccountInvite.created_at > now - timedelta(days=1)))
    if (sent_today or 0) >= limits.invites_per_day:
        raise TeamError(f"This account has sent {limits.invites_per_day} invitations in the last day: "
                        "try again tomorrow.", 429)
    seats = len(await members(db, account_id)) + len(await pending_invites(db, account_id, now))
    if seats >= limits.max_members:
        raise TeamError(f"An account has at most {limits.max_members} members (pending invitations count): "
                        "remove a member first.", 409)
    token = secrets.token_urlsafe(32)
    row = AccountInvite(account_id=account_id, email=email, role=role, token_hash=token_hash(token),
                        invited_by_user_id=inviter.id, created_at=now, expires_at=now + limits.invite_ttl)
    db.add(row)
    await db.flush()
    record(db, actor_of(inviter), "member.invite", "account_invite", row.id, None, snapshot(row),
           account_id=account_id)
    return row, token


async def cancel_invite(db: AsyncSession, account_id: int, actor: ConsoleUser, actor_role: str, invite_id: int,
                        now: datetime) -> None:
    """The pending invitation's link stops working (it expires now)."""
    row = await db.scalar(select(AccountInvite).where(AccountInvite.id == invite_id,
                                                      AccountInvite.account_id == account_id).with_for_update())
    if row is None or row.accepted_at is not None or row.expires_at <= now:
        raise TeamError("No pending invitation of that number in this account.", 404)
    if not roles.may_manage(actor_role, row.role):
        raise TeamError("Only owners and admins can cancel invitations (an owner's, only an owner).", 403)
    before = snapshot(row)
    row.expires_at = now
    record(db, actor_of(actor), "member.invite_cancel", "account_invite", row.id, before, snapshot(row),
           account_id=account_id)


async def open_invite(db: AsyncSession, token: str, now: datetime) -> AccountInvite:
    """The invitation the link names, if it can still be accepted; TeamError (410) otherwise."""
    row = None
    if len(token) == TOKEN_LENGTH:
        row = await db.scalar(select(AccountInvite).where(AccountInvite.token_hash == token_hash(token)))
    if row is None:
        raise TeamError("This invitation link is not valid. Ask the account's owner for a new one.", 404)
    if row.accepted_at is not None:
        raise TeamError("This invitation was already used. Ask the account's owner for a new one.", 410)
    if row.expires_at <= now:
        raise TeamError("This invitation has expired. Ask the account's owner for a new one.", 410)
    return row


async def accept(db: AsyncSession, token: str, user: ConsoleUser, limits: TeamLimits, now: datetime) -> AccountInvite:
    """Join the invitation's account as its role and act for it from now on. The link is spent by a
    conditional UPDATE, so of two clicks at once only one joins."""
    row = await open_invite(db, token, now)
    if row.email != user.email:
        raise TeamError(f"This invitation is for {row.email}: log in as that address to accept it.", 403)
    await _lock_account(db, row.account_id)
    spent = await db.execute(update(AccountInvite).where(AccountInvite.id == row.id,
                                                         AccountInvite.accepted_at.is_(None),
                                                         AccountInvite.expires_at > now)
                             .values(accepted_at=now, accepted_by_user_id=user.id)
                             .execution_options(synchronize_session=False))
    if spent.rowcount != 1:
        raise TeamError("This invitation was already used. Ask the account's owner for a new one.", 410)
    if await db.get(AccountMember, (row.account_id, user.id)) is not None:
        raise TeamError("You are already a member of this account.", 409)
    if len(await members(db, row.account_id)) >= limits.max_members:
        raise TeamError("This account is full: ask its owner to remove a member first.", 409)
    member = await add_member(db, row.account_id, user.id, row.role)
    user.account_id = row.account_id
    record(db, actor_of(user), "member.join", "account_member", user.id, None,
           {**snapshot(member), "email": user.email, "invite_id": row.id}, account_id=row.account_id)
    return row


async def change_role(db: AsyncSession, account_id: int, actor: ConsoleUser, actor_role: str, user_id: int,
                      new_role: str) -> AccountMember:
    _check_role(new_role)
    await _lock_account(db, account_id)
    member = await _membership(db, account_id, user_id)
    if not roles.may_manage(actor_role, member.role, new_role):
        raise TeamError("Only an owner can change an owner's role or make an owner.", 403)
    if member.role == MemberRole.OWNER and new_role != MemberRole.OWNER and await _owners(db, account_id) <= 1:
        raise TeamError("An account needs an owner: make another member owner first.", 409)
    before = snapshot(member)
    member.role = new_role
    record(db, actor_of(actor), "member.role", "account_member", user_id, before, snapshot(member),
           account_id=account_id)
    return member


async def remove(db: AsyncSession, account_id: int, actor: ConsoleUser, actor_role: str, user_id: int,
                 move_keys_to: int | None = None) -> tuple[int, int]:
    """Remove a member (or, with ``actor`` themselves, leave); the keys they made in the account are
    revoked, or moved to member ``move_keys_to``. (Keys revoked, keys moved.)"""
    await _lock_account(db, account_id)
    member = await _membership(db, account_id, user_id)
    leaving = actor.id == user_id
    if not leaving and not roles.may_manage(actor_role, member.role):
        raise TeamError("Only an owner can remove an owner." if roles.may(actor_role, roles.Area.TEAM)
                        else "Only owners and admins can remove members.", 403)
    if member.role == MemberRole.OWNER and await _owners(db, account_id) <= 1:
        raise TeamError("An account needs an owner: the last owner cannot leave or be removed. "
                        "Make another member owner first.", 409)
    if move_keys_to is not None:
        if move_keys_to == user_id:
            raise TeamError("Move the keys to another member, or revoke them.")
        heir = await _membership(db, account_id, move_keys_to)
        if not roles.may(heir.role, roles.Area.KEYS):
            raise TeamError("Move the keys to a member who may use keys (owner, admin or developer).")
    actor_name = actor_of(actor)
    keys = list(await db.scalars(select(ApiKey).where(ApiKey.account_id == account_id,
                                                      ApiKey.created_by_user_id == user_id,
                                                      ApiKey.revoked_at.is_(None)).with_for_update()))
    for key in keys:
        before = snapshot(key)
        if move_keys_to is None:
            revoke(key)
            record(db, actor_name, "key.revoke", "key", key.id, before, snapshot(key), account_id=account_id)
        else:
            key.created_by_user_id = move_keys_to
            record(db, actor_name, "key.move", "key", key.id, before, snapshot(key), account_id=account_id)
    user = await db.get(ConsoleUser, user_id, with_for_update=True)
    before = {**snapshot(member), "email": user.email if user else None}
    await db.delete(member)
    await db.flush()
    if user is not None and user.account_id == account_id:  # they act for another account of theirs, or none
        user.account_id = await db.scalar(select(AccountMember.account_id).where(AccountMember.user_id == user_id)
                                          .order_by(AccountMember.account_id).limit(1))
    record(db, actor_name, "member.leave" if leaving else "member.remove", "account_member", user_id, before,
           {"keys_revoked": 0 if move_keys_to else len(keys), "keys_moved_to": move_keys_to,
            "keys_moved": len(keys) if move_keys_to else 0}, account_id=account_id)
    return (0, len(keys)) if move_keys_to else (len(keys), 0)


async def activity(db: AsyncSession, account_id: int, limit: int = 50) -> list[AuditEntry]:
    """The account's audit entries (its team's activity), newest first."""
    return list(await db.scalars(select(AuditEntry).where(AuditEntry.account_id == account_id)
                                 .order_by(AuditEntry.id.desc()).limit(limit)))
