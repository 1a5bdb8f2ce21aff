"""README's plans table against the seeded plans: every cap a plan has is a column, with the value the
migrations seed, so the table users read cannot drift from the data the gateway enforces."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import inspect, select

from flatfare.storage.models import Plan

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| plan | requests a day |"
# Columns of a plan that are not caps or prices: its identity and its state.
NOT_CAPS = {"name", "display_name", "retired", "trial_days"}


def _table() -> tuple[list[str], dict[str, dict[str, str]], str]:
    """The table's header, its rows by plan name, and the paragraph after it."""
    text = README.read_text()
    start = text.index(HEADER)
    lines = text[start:].splitlines()
    table = lines[:next(n for n, line in enumerate(lines) if not line.startswith("|"))]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    header, body = cells[0], cells[2:]
    after = "\n".join(lines[len(table):]).strip().split("\n\n")[0]
    return header, {row[0].strip("`"): dict(zip(header, row, strict=True)) for row in body}, after


def _number(cell: str) -> int | None:
    """The leading number of a cell ("1,000, for 7 days" -> 1000); None for words ("the model's context")."""
    found = re.match(r"\$?([\d,]+(?:\.\d+)?)", cell)
    return None if found is None else float(found.group(1).replace(",", ""))


def _seeded(plan: Plan) -> dict[str, object]:
    return {"requests a day": plan.daily_limit, "price per request": plan.price_per_request_micros / 1e6,
            "monthly": plan.monthly_price_cents / 100, "lane": plan.lane, "models": plan.allowed_models,
            "sequences a request (prompts x `n` x `best_of`)": plan.max_n, "output tokens": plan.max_output_tokens,
            "input tokens": plan.max_prompt_tokens, "body": plan.max_body_bytes,
            "requests in flight": plan.max_inflight, "embedding inputs a request": plan.max_embedding_inputs,
            "batch discount": plan.batch_discount_percent, "batch lines a day": plan.batch_daily_limit,
            "the day's timezone": plan.timezone}


def _read(column: str, cell: str) -> object:
    if column in ("lane", "the day's timezone"):
        return cell
    if column == "models":
        return None if cell == "all" else [name.strip("` ") for name in cell.split(",")]
    if column == "body":
        return int(_number(cell)) * 1024 * 1024
    if column == "monthly" and cell == "contract":
        return 0
    value = _number(cell)
    return value if column in ("price per request", "monthly") or value is None else int(value)


async def test_the_readme_plans_table_shows_every_seeded_cap(sessions) -> None:
    header, rows, columns = _table()
    async with sessions() as session:
        plans = {plan.name: plan for plan in await session.scalars(select(Plan))}
    assert set(rows) == set(plans)
    for name, plan in plans.items():
        seeded = _seeded(plan)
        assert set(seeded) == set(header[1:])
        shown = {column: _read(column, rows[name][column]) for column in seeded}
        assert shown == seeded, name
    # Every column of the plans table that is a cap is named under the table.
    caps = {column.key for column in inspect(Plan).mapper.column_attrs} - NOT_CAPS
    assert {cap for cap in caps if f"`{cap}`" not in columns} == set()
