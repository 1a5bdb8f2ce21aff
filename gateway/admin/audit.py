"""Recording admin writes, and the small helpers every admin route shares."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Annotated, Any

from fastapi import Path, Query
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.models import AuditEntry, Base
from flatfare.gateway.admin.auth import Admin
from flatfare.gateway.errors import APIError

# Never copied into the audit log.
_SECRET_COLUMNS = {"key_hash", "token_hash"}

# Row ids are SQL INTEGERs (32 bits in PostgreSQL): a larger one fails in the database driver (a 500),
# so the route refuses it (422) instead.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
IdFilter = Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)]


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


def record(session: AsyncSession, admin: Admin, action: str, resource_type: str, resource_id: object,
           before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
    """Add the audit entry to the session: it commits with the change it describes, or not at all."""
    session.add(AuditEntry(at=datetime.now(UTC), actor_id=admin.token_id, actor=admin.name, action=action,
                           resource_type=resource_type, resource_id=str(resource_id), before=before, after=after))


def not_found(kind: str, key: object) -> APIError:
    return APIError(404, f"No {kind} '{key}'.", code=f"{kind}_not_found")


def page(rows: list[Any], limit: int, cursor_of) -> dict[str, Any]:  # noqa: ANN001 - row -> cursor
    """Rows were fetched with ``limit + 1``: the extra one only says there is more."""
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {"object": "list", "data": rows, "has_more": has_more,
            "next_cursor": str(cursor_of(rows[-1])) if has_more and rows else None}
