"""The lane share: premium first, but standard keeps its guaranteed share; and a claim pass, against
a real redis-server, in lane order within the worker's free slots."""

from __future__ import annotations


from flatfare.contract import Lane
from flatfare.workers.claims import Claimer, LaneShare


def test_standard_gets_one_claim_in_five_under_premium_load() -> None:
    share = LaneShare(0.2)
    served = []
    for _ in range(100):
        lane = Lane.STANDARD if share.standard_first() else Lane.PREMIUM
        share.took(lane, 1)
        served.append(lane)
    assert served.count(Lane.STANDARD) == 20
    assert Lane.STANDARD not in served[:4]  # premium goes first


def test_credit_is_bounded_after_a_long_premium_only_stretch() -> None:
    share = LaneShare(0.2)
    share.took(Lane.PREMIUM, 10_000)
    assert share.credit == 8.0



async def test_a_claim_pass_takes_own_then_premium_then_standard_within_free(redis) -> None:
    claimer = Claimer(redis, "m", "w1")
    await claimer.setup()
    for stream, count in ((claimer.own, 1), (claimer.lanes[Lane.PREMIUM], 2), (claimer.lanes[Lane.STANDARD], 3)):
        for i in range(count):
            await redis.xadd(stream, {"id": f"{stream}-{i}"})
    first = await claimer.claim(4, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in first] == [(None, 1), (Lane.PREMIUM, 2), (Lane.STANDARD, 1)]
    assert first[1].entries[0][1] == {b"id": f"{claimer.lanes[Lane.PREMIUM]}-0".encode()}
    rest = await claimer.claim(10, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in rest] == [(Lane.STANDARD, 2)]
    assert await claimer.claim(10, block_ms=10) == []  # nothing left: the blocking read times out


async def test_standard_is_served_first_once_it_has_earned_a_slot(redis) -> None:
    claimer = Claimer(redis, "m", "w2")
    await claimer.setup()
    claimer.share.credit = 1.0
    for lane in (Lane.PREMIUM, Lane.STANDARD):
        await redis.xadd(claimer.lanes[lane], {"id": lane.value})
    claimed = await claimer.claim(1, block_ms=10)
    assert [(c.lane, len(c.entries)) for c in claimed] == [(Lane.STANDARD, 1)]


async def test_renewal_names_the_held_jobs_redis_lost(redis) -> None:
    """Renewing returns nothing while the entries are pending; after the data is gone (FLUSHALL, a
    restart without persistence) every held entry comes back as lost, and a group made again (the
    claim loop does that) does not hide the loss."""
    claimer = Claimer(redis, "m", "w3")
    await claimer.setup()
    premium, standard = claimer.lanes[Lane.PREMIUM], claimer.lanes[Lane.STANDARD]
    await redis.xadd(premium, {"id": "a"})
    await redis.xadd(standard, {"id": "b"})
    held: dict[str, list[bytes]] = {}
    for batch in await claimer.claim(2, block_ms=10):
        held[batch.stream] = [entry_id for entry_id, _ in batch.entries]
    assert sum(map(len, held.values())) == 2
    assert await claimer.renew(held) == set()
    await redis.flushall()
    everything = {(stream, entry_id) for stream, ids in held.items() for entry_id in ids}
    assert await claimer.renew(held) == everything
    await claimer.setup()
    assert await claimer.renew(held) == everything
