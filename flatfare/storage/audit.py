"""The audit log's entries: who changed what, and the row before and after, added to the transaction that
makes the change (it commits with the change, or not at all). The admin services audit every write
they make; billing's plan changes audit those no admin made (a Stripe subscription, a customer's trial)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.models import AuditEntry, Base

# Never copied into the audit log.
_SECRET_COLUMNS = {"key_hash", "token_hash"}


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change, as the log names them: an admin token's id (None for anyone else: a console
    admin user, a customer, Stripe) and a name."""

    token_id: int | None
    name: str


def snapshot(row: Base | None) -> dict[str, Any] | None:
    """A JSON-safe copy of a row's columns, without secrets."""
    if row is None:
        return None
    out: dict[str, Any] = {}
    for column in inspect(row).mapper.column_attrs:
        if column.key in _SECRET_COLUMNS:
            continue
        value = getattr(row, column.key)
        out[column.key] = value.isoformat() if isinstance(value, (datetime, date)) else value
    return out


def record(session: AsyncSession, actor: Actor, action: str, resource_type: str, resource_id: object,
           before: dict[str, Any] | None, after: dict[str, Any] | None, *, account_id: int | None = None) -> None:
    """Add the audit entry to the session: it commits with the change it describes, or not at all.
    ``account_id``: the account a console member acted in (its team's activity page lists it)."""
    session.add(AuditEntry(at=datetime.now(UTC), actor_id=actor.token_id, actor=actor.name, action=action,
                           resource_type=resource_type, resource_id=str(resource_id), before=before, after=after,
                           account_id=account_id))
