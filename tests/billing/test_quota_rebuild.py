"""A rebuild of the quota counters replaces every counter of the days it rebuilds, against a real Redis."""

from __future__ import annotations

from flatfare import contract
from flatfare.billing.quota import DailyQuota

DAY, NEXT, FAR = "2026-12-03", "2026-12-04", "2026-12-20"


async def test_a_rebuild_replaces_the_counters_of_its_days_and_leaves_other_days_alone(redis) -> None:
    async def ledger(days: list[str], leave_out: tuple[str, ...] = ()) -> dict[tuple[int, str], int]:
        return {(1, DAY): 3}  # only account 1 has billable rows

    await redis.set(contract.quota_counter_key(1, DAY), 40)  # wrong: the ledger says 3
    await redis.set(contract.quota_counter_key(9, DAY), 5)  # an account without rows that day
    await redis.set(contract.quota_counter_key(9, NEXT), 5)  # a neighbour day is rebuilt too
    await redis.set(contract.quota_counter_key(9, FAR), 7)  # a day the rebuild does not touch
    await DailyQuota(redis, ledger).rebuild(DAY)
    assert await redis.get(contract.QUOTA_EPOCH_KEY)  # the counters are trusted again
    assert int(await redis.get(contract.quota_counter_key(1, DAY))) == 3
    assert not await redis.exists(contract.quota_counter_key(9, DAY), contract.quota_counter_key(9, NEXT))
    assert int(await redis.get(contract.quota_counter_key(9, FAR))) == 7
    assert not await redis.exists(contract.QUOTA_REBUILD_LOCK_KEY)
