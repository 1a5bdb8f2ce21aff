"""What every admin route shares: row ids in paths and filters, list pages, the 404 of a missing row.
(Audit entries are :mod:`flatfare.storage.audit`'s, added by the admin services' audited write.)"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path, Query

from flatfare.gateway.errors import APIError

# Row ids are SQL INTEGERs (32 bits in PostgreSQL): a larger one fails in the database driver (a 500),
# so the route refuses it (422) instead.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
IdFilter = Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)]


def not_found(kind: str, key: object) -> APIError:
    return APIError(404, f"No {kind} '{key}'.", code=f"{kind}_not_found")


def page(rows: list[Any], limit: int, cursor_of) -> dict[str, Any]:  # noqa: ANN001 - row -> cursor
    """Rows were fetched with ``limit + 1``: the extra one only says there is more."""
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {"object": "list", "data": rows, "has_more": has_more,
            "next_cursor": str(cursor_of(rows[-1])) if has_more and rows else None}
