"""What each member role of an account may do in the console (and whom its notices reach): plain rules,
no HTTP or database.

owner: everything. admin: everything but touching owners (no owner is made, changed or removed by an
admin). developer: keys and usage (the playground and quick start use keys). billing: plan and
invoices only. Every member may see the team and their own account page, and leave.
"""

from __future__ import annotations

from enum import StrEnum

from flatfare.storage.models import MemberRole

ROLES: tuple[MemberRole, ...] = (MemberRole.OWNER, MemberRole.ADMIN, MemberRole.DEVELOPER, MemberRole.BILLING)


class Area(StrEnum):
    """A part of the console a role may open."""

    KEYS = "keys"  # API keys, the playground, quick start
    USAGE = "usage"  # usage pages and quota alerts
    BILLING = "billing"  # plan, checkout, portal, the trial
    TEAM = "team"  # invite, change roles, remove members


_AREAS: dict[MemberRole, frozenset[Area]] = {
    MemberRole.OWNER: frozenset(Area),
    MemberRole.ADMIN: frozenset(Area),
    MemberRole.DEVELOPER: frozenset({Area.KEYS, Area.USAGE}),
    MemberRole.BILLING: frozenset({Area.BILLING}),
}


def areas(role: str) -> frozenset[Area]:
    """The areas ``role`` opens (none for a role this version does not know)."""
    try:
        return _AREAS[MemberRole(role)]
    except ValueError:
        return frozenset()


def roles_with(area: Area) -> list[str]:
    """The roles that open ``area`` (whom a notice about it is emailed to)."""
    return [role.value for role in ROLES if area in _AREAS[role]]


def may(role: str, area: Area) -> bool:
    return area in areas(role)


def may_manage(actor_role: str, target_role: str, new_role: str | None = None) -> bool:
    """Whether a member of ``actor_role`` may change (to ``new_role``) or remove a member of
    ``target_role``, or invite one of ``target_role``: managers only, and only an owner touches owners."""
    if not may(actor_role, Area.TEAM):
        return False
    if actor_role == MemberRole.OWNER:
        return True
    return MemberRole.OWNER not in (target_role, new_role)
