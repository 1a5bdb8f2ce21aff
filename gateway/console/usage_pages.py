"""The customer's usage page: today's requests against the plan, requests per day over 30 days, by
model and by key (charts and a table), and the table as CSV. Everything is read from the usage rollup
(billing/rollup.py) of the logged-in customer's own account: no route takes an account or key id."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flatfare.billing import rollup
from flatfare.billing.plans import quota_window
from flatfare.gateway.console.deps import Customer, UsageMember
from flatfare.gateway.console.pages import render
from flatfare.gateway.app_state import Services, services_of

router = APIRouter(prefix="/console", include_in_schema=False)
HISTORY_DAYS = 30
CSV_COLUMNS = ["day", "key_id", "key_name", "key_prefix", "model", "requests", "billable_requests", "price_usd"]


async def usage_view(state: Services, customer: Customer, now: datetime) -> dict[str, Any]:
    """What the page shows, for the customer's own account only."""
    terms = await state.plans.terms(customer.account, now)
    window = quota_window(terms.plan.timezone, now)
    days = rollup.days_back(window.day, HISTORY_DAYS)
    account_id = customer.account.id
    async with state.sessions() as session:
        daily = await rollup.account_daily(session, account_id, days)
        by_model = await rollup.account_by_model(session, account_id, days[0], days[-1])
        by_key = await rollup.account_by_key(session, account_id, days[0], days[-1])
        rows = await rollup.account_rows(session, account_id, days[0], days[-1])
    today = daily[-1]
    limit = terms.daily_limit
    return {
        "plan": terms.plan, "limit": limit, "today": today, "resets_at": window.resets_at,
        "used_percent": None if not limit else min(100, round(100 * today.billable_requests / limit)),
        "days": daily, "by_model": by_model, "by_key": by_key, "rows": rows,
        "total": sum(day.requests for day in daily), "total_billable": sum(day.billable_requests for day in daily),
        "chart": json.dumps({
            "labels": [day.day[5:] for day in daily], "days": [day.day for day in daily],
            "requests": [day.requests for day in daily], "billable": [day.billable_requests for day in daily],
            "models": {"labels": [row["model"] for row in by_model], "requests": [row["requests"] for row in by_model]},
            "keys": {"labels": [row["name"] or f"{row['prefix']}…" for row in by_key],
                     "requests": [row["requests"] for row in by_key]}}),
    }


@router.get("/usage")
async def usage_page(request: Request, customer: UsageMember) -> Response:
    view = await usage_view(services_of(request), customer, datetime.now(UTC))
    return render(request, "usage.html", {"customer": customer, **view})


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(text: str) -> str:
    """A text cell a spreadsheet will not run: one that starts (after any leading whitespace, which
    spreadsheets skip) like a formula gets a leading quote. Key names and model names are client text."""
    if text[:1] in FORMULA_STARTS or text.lstrip()[:1] in FORMULA_STARTS:
        return "'" + text
    return text


@router.get("/usage.csv")
async def usage_csv(request: Request, customer: UsageMember) -> Response:
    """The page's table over the last 30 days, one row per day, key and model."""
    view = await usage_view(services_of(request), customer, datetime.now(UTC))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for row in view["rows"]:
        writer.writerow([row["day"], row["key_id"], spreadsheet_safe(row["key_name"]),
                         spreadsheet_safe(row["key_prefix"]), spreadsheet_safe(row["model"]), row["requests"],
                         row["billable_requests"], f"{row['price_micros'] / 1e6:.6f}"])
    filename = f"flatfare-usage-{view['days'][0].day}-{view['days'][-1].day}.csv"
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{filename}"',
                             "Cache-Control": "no-store"})
