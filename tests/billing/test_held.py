"""The reaper settles what a dead gateway process held, against real Redis and SQL: units of requests
it never recorded or never finished come back, charged ones stay, open rows close free, once."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from sqlalchemy import select

from flatfare.billing.ledger import Charge, Ledger, Outcome
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, DailyQuota, counter_key, expiry
from flatfare import contract
from flatfare.contract import Endpoint, Job, Lane
from flatfare.storage.accounts import issue_key
from flatfare.billing.plan_change import ensure_account
from flatfare.storage.models import RequestRecord, RequestStatus
from flatfare.billing.held import LOST_CODE, HeldUnits
from flatfare.gateway.jobpath.queueing import LaneLimits, LaneQueue, QuotaClaim


async def test_a_dead_gateways_units_are_settled_once(redis, sessions) -> None:
    await redis.set(EPOCH_KEY, "g0")
    async with sessions() as session:
        issued = await issue_key(session, await ensure_account(session, "acme", "pro"))
        await session.commit()
    ledger = Ledger(sessions)
    quota = DailyQuota(redis, ledger.billable_counts)
    window = quota_window("UTC", datetime.now(UTC))
    claim = QuotaClaim(issued.account_id, window.day, 100, expiry(window.resets_at))
    dead = LaneQueue(redis, {lane: LaneLimits(100, 60.0) for lane in Lane}, quota,
                     contract.held_units("dead"))
    charge = Charge(plan="pro", price_micros=1000, quota_day=window.day)
    for i in range(3):
        await dead.admit(Job(request_id=f"r{i}", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0), "m", claim)
    # r0 finished and was charged (its release never flushed); r1 is mid-run (row open); r2 died
    # between admission and its row's commit.
    for request_id in ("r0", "r1"):
        await ledger.open(request_id=request_id, account_id=issued.account_id, api_key_id=issued.key_id,
                          model="m", endpoint="chat", stream=False, created_at=datetime.now(UTC), charge=charge)
    await ledger.close("r0", Outcome(RequestStatus.SUCCEEDED, 200))
    await redis.zadd(contract.GATEWAYS_KEY, {"dead": int(time.time() * 1000) - 60_000,
                                             "alive": int(time.time() * 1000)})

    reaper = HeldUnits(redis, "alive", ledger, quota, dead_after_s=30)
    assert await reaper.reap() == 2
    assert int(await redis.get(counter_key(issued.account_id, window.day))) == 1  # only r0's unit stays
    async with sessions() as session:
        rows = {r.id: r for r in await session.scalars(select(RequestRecord))}
    assert (rows["r0"].status, rows["r0"].billable) == ("succeeded", True)
    assert (rows["r1"].status, rows["r1"].billable, rows["r1"].error_code) == ("failed", False, LOST_CODE)
    assert "r2" not in rows
    assert await redis.exists(contract.cancel_key("r1"), contract.cancel_key("r2")) == 2
    assert not await redis.exists(contract.held_units("dead"))
    assert await redis.zrange(contract.GATEWAYS_KEY, 0, -1) == [b"alive"]
    assert await reaper.reap() == 0  # nothing twice
    assert int(await redis.get(counter_key(issued.account_id, window.day))) == 1
    ledger.dispose()


async def test_a_live_gateway_releases_charged_units_and_leaves_when_idle(redis, sessions) -> None:
    ledger = Ledger(sessions)
    held = HeldUnits(redis, "me", ledger, DailyQuota(redis, ledger.billable_counts), dead_after_s=30)
    await redis.hset(held.key, mapping={"a": "1:2026-12-03", "b": "1:2026-12-03"})
    held.release("a")
    held.release("b")
    held.start()
    await held.stop()
    assert not await redis.exists(held.key)
    assert not await redis.zscore(contract.GATEWAYS_KEY, "me")
    ledger.dispose()


async def test_an_admission_whose_answer_was_lost_is_settled_once_redis_answers(redis, sessions) -> None:
    """Redis ran the admission script, then went away before its answer reached the gateway, which
    refused the request (503) and wrote no row: once Redis answers again, the unit comes back and
    the job is cancelled. One that never ran is not given back anything."""
    await redis.set(EPOCH_KEY, "g0")
    ledger = Ledger(sessions)
    quota = DailyQuota(redis, ledger.billable_counts)
    window = quota_window("UTC", datetime.now(UTC))
    held = HeldUnits(redis, "me", ledger, quota, dead_after_s=30)
    queue = LaneQueue(redis, {lane: LaneLimits(100, 60.0) for lane in Lane}, quota, held.key)
    claim = QuotaClaim(7, window.day, 100, expiry(window.resets_at))
    await queue.admit(Job(request_id="ran", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0), "m", claim)
    await queue.admit(Job(request_id="kept", endpoint=Endpoint.CHAT, body="{}", enqueued_ms=0), "m", claim)
    held.give_back_later(7, window.day, "ran", "")
    held.give_back_later(7, window.day, "never-ran", "")
    held.start()
    try:
        deadline = time.monotonic() + 5
        while await redis.hexists(held.key, "ran"):
            assert time.monotonic() < deadline, "the unit of the admission whose answer was lost is still held"
            await asyncio.sleep(0.05)
    finally:
        await held.stop()
    assert int(await redis.get(counter_key(7, window.day))) == 1  # "kept"'s unit only
    assert await redis.exists(contract.cancel_key("ran"))
    ledger.dispose()
