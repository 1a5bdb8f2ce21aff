"""Usage rolled up from the ledger, and the queries the usage pages ask of it.

The ledger writes :class:`Rollup` deltas in the same transaction as the rows they sum (opened: one
request, billable if charged; closed or abandoned free: one billable request and its price less), so
``usage_daily`` always equals a GROUP BY over ``requests`` per account, key, model and day, and
``usage_platform_daily`` the same per day and model. A page reads a few dozen rollup rows instead of
scanning the ledger (bench/results/console.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from flatfare.storage.models import ApiKey, PlatformUsageDaily, UsageDaily, as_utc

# One statement for SQLite (3.24+) and PostgreSQL alike, with named parameters both drivers take
# (SQLAlchemy's text() and sqlite3's executemany).
_SUMS = "requests = {t}.requests + excluded.requests, " \
        "billable_requests = {t}.billable_requests + excluded.billable_requests, " \
        "price_micros = {t}.price_micros + excluded.price_micros"
UPSERT_ACCOUNT = (
    "INSERT INTO usage_daily (account_id, day, api_key_id, model, requests, billable_requests, price_micros) "
    "VALUES (:account_id, :day, :api_key_id, :model, :requests, :billable_requests, :price_micros) "
    "ON CONFLICT (account_id, day, api_key_id, model) DO UPDATE SET " + _SUMS.format(t="usage_daily"))
UPSERT_PLATFORM = (
    "INSERT INTO usage_platform_daily (day, model, requests, billable_requests, price_micros) "
    "VALUES (:day, :model, :requests, :billable_requests, :price_micros) "
    "ON CONFLICT (day, model) DO UPDATE SET " + _SUMS.format(t="usage_platform_daily"))


def day_of(quota_day: str | None, created_at: datetime | str) -> str:
    """A ledger row's day: its quota day (the plan's calendar day), else its UTC date (a row written
    without a charge). SQLite hands ``created_at`` back as its stored UTC text."""
    if quota_day:
        return quota_day
    return created_at[:10] if isinstance(created_at, str) else as_utc(created_at).date().isoformat()


class Rollup:
    """The deltas of one ledger transaction, summed per rollup row."""

    def __init__(self) -> None:
        self._sums: dict[tuple[int, str, int, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def add(self, *, account_id: int, api_key_id: int, model: str, day: str, requests: int = 0,
            billable: int = 0, price_micros: int = 0) -> None:
        sums = self._sums[(account_id, day, api_key_id, model)]
        sums[0] += requests
        sums[1] += billable
        sums[2] += price_micros

    def opened(self, row: dict[str, Any]) -> None:
        """A new ledger row: one request, billable (with its price) if it was charged."""
        billable = bool(row["billable"])
        self.add(account_id=row["account_id"], api_key_id=row["api_key_id"], model=row["model"],
                 day=day_of(row["quota_day"], row["created_at"]), requests=1, billable=int(billable),
                 price_micros=row["price_micros"] if billable else 0)

    def made_free(self, *, account_id: int, api_key_id: int, model: str, day: str, price_micros: int) -> None:
        """A billable row closed free: its unit and price given back."""
        self.add(account_id=account_id, api_key_id=api_key_id, model=model, day=day, billable=-1,
                 price_micros=-price_micros)

    def __bool__(self) -> bool:
        return bool(self._sums)

    def account_rows(self) -> list[dict[str, Any]]:
        """Parameters for :data:`UPSERT_ACCOUNT`, in key order: every writer locks rollup rows in the
        same order, so two PostgreSQL transactions never deadlock on them."""
        return [{"account_id": a, "day": d, "api_key_id": k, "model": m, "requests": r, "billable_requests": b,
                 "price_micros": p} for (a, d, k, m), (r, b, p) in sorted(self._sums.items()) if r or b or p]

    def platform_rows(self) -> list[dict[str, Any]]:
        """Parameters for :data:`UPSERT_PLATFORM`, in key order."""
        sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for (_, day, _, model), values in self._sums.items():
            sums[(day, model)] = [x + y for x, y in zip(sums[(day, model)], values, strict=True)]
        return [{"day": d, "model": m, "requests": r, "billable_requests": b, "price_micros": p}
                for (d, m), (r, b, p) in sorted(sums.items()) if r or b or p]


# --- Queries (each reads rollup rows of one account or of a range of days, through the primary keys) ---


@dataclass(frozen=True, slots=True)
class DayUsage:
    day: str
    requests: int
    billable_requests: int
    price_micros: int


def days_back(last: str, count: int) -> list[str]:
    """``count`` calendar days ending with ``last`` (ISO dates), oldest first."""
    end = date.fromisoformat(last)
    return [(end - timedelta(days=offset)).isoformat() for offset in range(count - 1, -1, -1)]


def _sums(table: Any) -> tuple[Any, Any, Any]:
    return (func.coalesce(func.sum(table.requests), 0), func.coalesce(func.sum(table.billable_requests), 0),
            func.coalesce(func.sum(table.price_micros), 0))


def _per_day(rows: Iterable[Any], days: list[str]) -> list[DayUsage]:
    found = {row[0]: row for row in rows}
    return [DayUsage(day, *(int(value) for value in found[day][1:])) if day in found else DayUsage(day, 0, 0, 0)
            for day in days]


async def account_day(session: AsyncSession, account_id: int, day: str) -> DayUsage:
    """One account's requests on ``day`` (its quota day): what today's count against the plan shows."""
    return (await account_daily(session, account_id, [day]))[0]


async def account_daily(session: AsyncSession, account_id: int, days: list[str]) -> list[DayUsage]:
    """One account's usage per day over ``days`` (consecutive, oldest first), days without requests as 0."""
    rows = await session.execute(
        select(UsageDaily.day, *_sums(UsageDaily))
        .where(UsageDaily.account_id == account_id, UsageDaily.day.between(days[0], days[-1]))
        .group_by(UsageDaily.day))
    return _per_day(rows, days)


async def account_by_model(session: AsyncSession, account_id: int, since: str, until: str) -> list[dict[str, Any]]:
    """One account's usage per model between two days (inclusive), busiest first."""
    rows = await session.execute(
        select(UsageDaily.model, *_sums(UsageDaily))
        .where(UsageDaily.account_id == account_id, UsageDaily.day.between(since, until))
        .group_by(UsageDaily.model))
    result = [{"model": model, "requests": int(r), "billable_requests": int(b), "price_micros": int(p)}
              for model, r, b, p in rows]
    return sorted(result, key=lambda row: (-row["requests"], row["model"]))


async def account_by_key(session: AsyncSession, account_id: int, since: str, until: str) -> list[dict[str, Any]]:
    """One account's usage per API key between two days (inclusive), with each key's name and prefix."""
    sums = (select(UsageDaily.api_key_id, *_sums(UsageDaily))
            .where(UsageDaily.account_id == account_id, UsageDaily.day.between(since, until))
            .group_by(UsageDaily.api_key_id).subquery())
    rows = await session.execute(
        select(sums.c.api_key_id, ApiKey.name, ApiKey.prefix, *list(sums.c)[1:])
        .join(ApiKey, ApiKey.id == sums.c.api_key_id))
    result = [{"key_id": key_id, "name": name, "prefix": prefix, "requests": int(r), "billable_requests": int(b),
               "price_micros": int(p)} for key_id, name, prefix, r, b, p in rows]
    return sorted(result, key=lambda row: (-row["requests"], row["key_id"]))


async def account_rows(session: AsyncSession, account_id: int, since: str, until: str) -> list[dict[str, Any]]:
    """One account's rollup rows between two days (inclusive): the usage table and its CSV export."""
    rows = await session.execute(
        select(UsageDaily.day, UsageDaily.api_key_id, ApiKey.name, ApiKey.prefix, UsageDaily.model,
               UsageDaily.requests, UsageDaily.billable_requests, UsageDaily.price_micros)
        .join(ApiKey, ApiKey.id == UsageDaily.api_key_id)
        .where(UsageDaily.account_id == account_id, UsageDaily.day.between(since, until))
        .order_by(UsageDaily.day.desc(), UsageDaily.api_key_id, UsageDaily.model))
    return [{"day": day, "key_id": key_id, "key_name": name, "key_prefix": prefix, "model": model,
             "requests": int(r), "billable_requests": int(b), "price_micros": int(p)}
            for day, key_id, name, prefix, model, r, b, p in rows]


async def platform_daily(session: AsyncSession, days: list[str]) -> list[DayUsage]:
    """The whole platform's requests, billable requests and billable revenue per day over ``days``."""
    rows = await session.execute(
        select(PlatformUsageDaily.day, *_sums(PlatformUsageDaily))
        .where(PlatformUsageDaily.day.between(days[0], days[-1]))
        .group_by(PlatformUsageDaily.day))
    return _per_day(rows, days)


async def platform_by_model(session: AsyncSession, since: str, until: str) -> dict[str, DayUsage]:
    """The whole platform's usage per model between two days (inclusive), e.g. requests today per model;
    each value's ``day`` is ``until``."""
    rows = await session.execute(
        select(PlatformUsageDaily.model, *_sums(PlatformUsageDaily))
        .where(PlatformUsageDaily.day.between(since, until))
        .group_by(PlatformUsageDaily.model))
    return {model: DayUsage(until, int(r), int(b), int(p)) for model, r, b, p in rows}
