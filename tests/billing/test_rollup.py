"""The usage rollup against the ledger it sums, on SQLite (the ledger's sqlite3 writer) and PostgreSQL
(SQLAlchemy Core): after a mix of billable, free, failed, given-back, abandoned, duplicate and refused
writes, in batches and one by one, ``usage_daily`` equals a GROUP BY over ``requests`` and
``usage_platform_daily`` the same per day and model; then the usage pages' queries read it back."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from flatfare.billing import rollup as usage
from flatfare.billing.ledger import Charge, DuplicateIdempotencyKey, Ledger, Outcome
from flatfare.storage.accounts import issue_key
from flatfare.storage.models import Account, PlatformUsageDaily, RequestRecord, RequestStatus, UsageDaily
from tests.billing.conftest import account_with_key

DAY, YESTERDAY = "2026-12-03", "2026-12-02"


def _charge(day: str, price: int = 2000) -> Charge:
    return Charge(plan="pro", price_micros=price, quota_day=day)


async def _ledger_sums(sessions: async_sessionmaker[AsyncSession]) -> tuple[dict, dict]:
    """What the rollup must say, computed from the ledger rows themselves."""
    per_key: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    async with sessions() as session:
        for row in await session.scalars(select(RequestRecord)):
            day = usage.day_of(row.quota_day, row.created_at)
            for sums in (per_key[(row.account_id, day, row.api_key_id, row.model)],):
                sums[0] += 1
                sums[1] += int(row.billable)
                sums[2] += row.price_micros if row.billable else 0
    platform: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (_, day, _, model), sums in per_key.items():
        platform[(day, model)] = [a + b for a, b in zip(platform[(day, model)], sums, strict=True)]
    return ({k: tuple(v) for k, v in per_key.items()}, {k: tuple(v) for k, v in platform.items()})


async def _rollup(sessions: async_sessionmaker[AsyncSession]) -> tuple[dict, dict]:
    async with sessions() as session:
        per_key = {(r.account_id, r.day, r.api_key_id, r.model): (r.requests, r.billable_requests, r.price_micros)
                   for r in await session.scalars(select(UsageDaily))}
        platform = {(r.day, r.model): (r.requests, r.billable_requests, r.price_micros)
                    for r in await session.scalars(select(PlatformUsageDaily))}
    # A row summed back to zero may stay: it says nothing the ledger disagrees with.
    return ({k: v for k, v in per_key.items() if v != (0, 0, 0)},
            {k: v for k, v in platform.items() if v != (0, 0, 0)})


async def test_the_rollup_equals_a_group_by_over_the_ledger(sessions) -> None:
    acme = await account_with_key(sessions, "acme")
    other = await account_with_key(sessions, "other", "free")
    async with sessions() as session:
        second = await issue_key(session, await session.get(Account, acme.account_id), name="ci")
        await session.commit()
    ledger = Ledger(sessions)
    now = datetime.now(UTC)
    east = timezone(timedelta(hours=9))

    def open_(request_id: str, key, model: str = "m", charge: Charge | None = None, **extra) -> asyncio.Future:
        return ledger.start_open(request_id=request_id, account_id=key.account_id, api_key_id=key.key_id,
                                 model=model, endpoint="chat", stream=False, created_at=extra.pop("at", now),
                                 charge=charge, **extra)

    try:
        # One batch: opens of every kind, on two days, two accounts, three keys, two models.
        opened = [open_(f"ok{i}", acme, charge=_charge(DAY)) for i in range(5)]
        opened += [open_(f"m2-{i}", second, "m2", _charge(DAY)) for i in range(3)]
        opened += [open_(f"old{i}", acme, charge=_charge(YESTERDAY)) for i in range(2)]
        opened += [open_(f"free{i}", other, charge=_charge(DAY, 0)) for i in range(4)]
        opened += [open_("uncharged", other, at=datetime(2026, 12, 1, 23, 30, tzinfo=east))]  # UTC day 2026-12-01
        opened += [open_(f"gone{i}", acme, charge=_charge(DAY)) for i in range(3)]
        opened += [open_(f"held{i}", second, "m2", _charge(DAY)) for i in range(2)]
        opened += [open_("still-queued", acme, charge=_charge(DAY))]
        await asyncio.gather(*map(Ledger.opened, opened))
        # Closes in one batch: succeeded (billable), failed before a token (given back), cancelled
        # billable, a duplicate close that must change nothing, a close of the uncharged row.
        await asyncio.gather(
            *(ledger.close(f"ok{i}", Outcome(RequestStatus.SUCCEEDED, 200, completion_tokens=3)) for i in range(4)),
            ledger.close("ok4", Outcome(RequestStatus.FAILED, 503, error_code="no_worker", billable=False)),
            ledger.close("ok4", Outcome(RequestStatus.FAILED, 503, error_code="no_worker", billable=False)),
            ledger.close("old0", Outcome(RequestStatus.CANCELLED, 499, billable=True)),
            ledger.close("old1", Outcome(RequestStatus.FAILED, 504, error_code="timeout", billable=False)),
            *(ledger.close(f"m2-{i}", Outcome(RequestStatus.SUCCEEDED, 200)) for i in range(3)),
            *(ledger.close(f"free{i}", Outcome(RequestStatus.FAILED, 500, billable=i % 2 == 0)) for i in range(4)),
            ledger.close("uncharged", Outcome(RequestStatus.SUCCEEDED, 200)))
        # A late close of a row already closed free: nothing changes.
        await ledger.close("ok4", Outcome(RequestStatus.SUCCEEDED, 200))
        # A gateway died holding these: another abandons them (free), twice.
        abandoned = await ledger.abandon(["gone0", "gone1", "gone2", "ok0", "missing"], "gateway_lost")
        assert abandoned == {"gone0": False, "gone1": False, "gone2": False, "ok0": True}
        assert abandoned.closed == 3  # ok0 was closed already
        again = await ledger.abandon(["gone0"], "gateway_lost")
        assert again == {"gone0": False} and again.closed == 0
        # A reused Idempotency-Key fails alone, and its rolled-back open counts nowhere.
        await ledger.open(request_id="idem1", account_id=acme.account_id, api_key_id=acme.key_id, model="m",
                          endpoint="chat", stream=False, created_at=now, charge=_charge(DAY), idempotency_key="k")
        with pytest.raises(DuplicateIdempotencyKey):
            await ledger.open(request_id="idem2", account_id=acme.account_id, api_key_id=acme.key_id, model="m",
                              endpoint="chat", stream=False, created_at=now, charge=_charge(DAY), idempotency_key="k")
        await ledger.close("held0", Outcome(RequestStatus.FAILED, 502, billable=False))
    finally:
        ledger.dispose()

    expected_keys, expected_platform = await _ledger_sums(sessions)
    assert await _rollup(sessions) == (expected_keys, expected_platform)
    # The mix did what it says: every kind of row is in the ledger.
    a, k1, k2 = acme.account_id, acme.key_id, second.key_id
    assert expected_keys[(a, DAY, k1, "m")] == (10, 6, 12_000)  # ok0-3, idem1, still-queued billable; ok4, gone0-2 free
    assert expected_keys[(a, YESTERDAY, k1, "m")] == (2, 1, 2000)
    assert expected_keys[(a, DAY, k2, "m2")] == (5, 4, 8000)
    assert expected_keys[(other.account_id, "2026-12-01", other.key_id, "m")] == (1, 0, 0)
    assert expected_keys[(other.account_id, DAY, other.key_id, "m")] == (4, 2, 0)

    async with sessions() as session:
        assert await usage.account_day(session, a, DAY) == usage.DayUsage(DAY, 15, 10, 20_000)
        daily = await usage.account_daily(session, a, usage.days_back(DAY, 30))
        assert len(daily) == 30 and daily[0].day == "2026-11-04"
        assert [(d.day, d.requests, d.billable_requests) for d in daily[-2:]] == [(YESTERDAY, 2, 1), (DAY, 15, 10)]
        assert sum(d.requests for d in daily[:-2]) == 0
        assert await usage.account_by_model(session, a, YESTERDAY, DAY) == [
            {"model": "m", "requests": 12, "billable_requests": 7, "price_micros": 14_000},
            {"model": "m2", "requests": 5, "billable_requests": 4, "price_micros": 8000}]
        by_key = await usage.account_by_key(session, a, DAY, DAY)
        assert [(row["key_id"], row["name"], row["requests"]) for row in by_key] == [(k1, "", 10), (k2, "ci", 5)]
        rows = await usage.account_rows(session, a, YESTERDAY, DAY)
        assert [(r["day"], r["key_id"], r["model"], r["requests"]) for r in rows] == [
            (DAY, k1, "m", 10), (DAY, k2, "m2", 5), (YESTERDAY, k1, "m", 2)]
        # Another account's rows never show in this one's answers.
        assert all(r["key_id"] in (k1, k2) for r in await usage.account_rows(session, a, "2026-12-01", DAY))
        platform = await usage.platform_daily(session, usage.days_back(DAY, 3))
        assert [(d.day, d.requests, d.billable_requests, d.price_micros) for d in platform] == [
            ("2026-12-01", 1, 0, 0), (YESTERDAY, 2, 1, 2000), (DAY, 19, 12, 20_000)]
        by_model = await usage.platform_by_model(session, DAY, DAY)
        assert {m: d.requests for m, d in by_model.items()} == {"m": 14, "m2": 5}


async def test_the_migration_backfills_the_rollup_from_existing_rows(database_url, sessions) -> None:
    """Rows written before the rollup existed (here: the rollup emptied, then the backfill's own SQL
    run again through alembic's downgrade and upgrade) are summed exactly as the ledger would."""
    from flatfare.storage.db import alembic_config

    from alembic import command

    acme = await account_with_key(sessions, "acme")
    ledger = Ledger(sessions)
    try:
        for i in range(3):
            await ledger.open(request_id=f"r{i}", account_id=acme.account_id, api_key_id=acme.key_id, model="m",
                              endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=_charge(DAY))
        await ledger.close("r0", Outcome(RequestStatus.FAILED, 503, billable=False))
        await ledger.open(request_id="plain", account_id=acme.account_id, api_key_id=acme.key_id, model="m",
                          endpoint="chat", stream=False, created_at=datetime(2026, 11, 30, 23, 59, tzinfo=UTC))
    finally:
        ledger.dispose()
    expected = await _ledger_sums(sessions)
    await asyncio.to_thread(command.downgrade, alembic_config(database_url), "0007")  # before the rollup
    async with sessions() as session:
        pro = await session.execute(text("SELECT monthly_price_cents FROM plans WHERE name = 'pro'"))
        assert pro.scalar() == 2000  # 0001's price again
    await asyncio.to_thread(command.upgrade, alembic_config(database_url), "head")
    assert await _rollup(sessions) == expected
    assert expected[0][(acme.account_id, "2026-11-30", acme.key_id, "m")] == (1, 0, 0)
