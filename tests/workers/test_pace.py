"""The pace governor (flatfare.workers.pace): the engine's pace learned from windows in which it kept up,
the limit cut under a backlog when the pace goes past the target and grown back when there is room, the
floor, the cooldown, and the ramp that keeps a burst from flooding the engine; then in the worker loop,
against a real Redis with the instant engine: standard jobs past the limit wait in their lane while a
premium job is taken at once."""

from __future__ import annotations

import asyncio

import pytest

from flatfare.contract import Lane, WorkerInfo
from flatfare.redis_conn import connect
from flatfare.workers.instant import InstantEngine
from flatfare.workers.loop import WorkerLoop
from flatfare.workers.pace import MIN_SAMPLES, PaceGovernor
from flatfare.workers.presence import now_ms
from tests.workers.test_loop import POOL, _answered, _job, _queue


def _window(governor: PaceGovernor, now: float, gap_s: float, streams: int = 4) -> float:
    """One window of inter-token latencies ``gap_s`` long on ``streams`` streams, as the engine reports them;
    returns the window's end."""
    governor.record([gap_s] * (MIN_SAMPLES * streams))
    return now + governor.window_s


def _learn(governor: PaceGovernor, gap_s: float, running: int, windows: int = 10) -> float:
    now = 0.0
    for _ in range(windows):
        now = _window(governor, now, gap_s)
        governor.tick(now, running, backlog=False)
    return now


def test_the_baseline_is_the_pace_of_windows_without_a_backlog() -> None:
    governor = PaceGovernor(ceiling=512, slack=1.3, floor=8)
    now = _learn(governor, 0.010, running=40)
    assert governor.baseline_s == pytest.approx(0.010)
    assert governor.target_s == pytest.approx(0.013)
    # A window with a backlog is the engine under overload: it teaches nothing about the pace to hold.
    now = _window(governor, now, 0.050)
    governor.tick(now, 40, backlog=True)
    assert governor.baseline_s == pytest.approx(0.010)
    # Nor does one with batch lines running beside the live jobs.
    now = _window(governor, now, 0.050)
    governor.tick(now, 40, backlog=False, batch=3)
    assert governor.baseline_s == pytest.approx(0.010)


def test_a_backlog_over_the_target_cuts_from_what_runs_once_a_cooldown() -> None:
    governor = PaceGovernor(ceiling=512, slack=1.3, floor=8, cooldown_s=2.0)
    now = _learn(governor, 0.010, running=200)
    assert governor.limit == 400  # twice what ran: room for a burst, not the whole ceiling
    now = _window(governor, now, 0.0143)  # 1.1x the target: cut by 0.85 (never less than 0.5, never more)
    assert governor.tick(now, 200, backlog=True) == 170
    now = _window(governor, now, 0.040)  # within the cooldown: held
    assert governor.tick(now, 200, backlog=True) == 170
    now = _window(governor, now + 2.0, 0.040)  # 3x the target: by half, from what runs (150 now)
    assert governor.tick(now, 150, backlog=True) == 75
    for _ in range(5):  # never below the floor: the standard lane always moves
        now = _window(governor, now + 2.0, 0.040)
        governor.tick(now, governor.limit, backlog=True)
    assert governor.limit == 8


def test_held_at_its_floor_the_governor_learns_the_pace_it_controls() -> None:
    """The first GPU rehearsal: a baseline from a quieter warm-up (8.5 ms) below what the engine did with the
    standard lane at its floor (11-13 ms: premium work, a second model on the GPU): the limit stayed at the
    floor the whole run. At the floor the pace is a reference, and the limit grows again."""
    governor = PaceGovernor(ceiling=896, slack=1.3, floor=16, cooldown_s=2.0)
    now = _learn(governor, 0.0085, running=20)
    for _ in range(8):
        now = _window(governor, now + 2.0, 0.030)
        governor.tick(now, governor.limit, backlog=True)
    assert governor.allowed == 16  # cut to the floor
    for _ in range(60):  # the pace at the floor, while work waits
        now = _window(governor, now, 0.012)
        governor.tick(now, 16, backlog=True)
    assert governor.baseline_s == pytest.approx(0.012)
    assert governor.allowed > 16 and governor.limit > 16


def test_room_under_the_target_grows_the_limit_back() -> None:
    governor = PaceGovernor(ceiling=100, slack=1.3, floor=4)
    now = _learn(governor, 0.010, running=30)
    now = _window(governor, now, 0.030)
    governor.tick(now, 30, backlog=True)
    cut = governor.allowed
    assert cut < 30
    now = _window(governor, now, 0.010)  # under 0.9 x target, the limit full and a backlog waiting: +1/16
    governor.tick(now, cut, backlog=True)
    assert governor.allowed == cut + max(1, cut // 16)
    now = _window(governor, now, 0.0125)  # between 0.9 x target and the target: held
    governor.tick(now, governor.allowed, backlog=True)
    assert governor.allowed == cut + max(1, cut // 16)
    for _ in range(200):
        now = _window(governor, now, 0.010)
        governor.tick(now, governor.allowed, backlog=True)
    assert governor.allowed == 100  # up to the ceiling, no further


def test_batch_lines_that_slow_the_pace_are_cut_and_the_standard_lane_is_not() -> None:
    """The first GPU rehearsal: one limit for both let batch lines that slowed the pace cut the standard lane,
    and live requests waited up to 0.6 s for a slot. The lines' own allowance goes first."""
    governor = PaceGovernor(ceiling=100, slack=1.3, floor=4, cooldown_s=2.0)
    now = _learn(governor, 0.010, running=20)
    governor.batch_allowed = 30
    now = _window(governor, now, 0.030)
    governor.tick(now, 20, backlog=True, batch=30)
    assert governor.batch_limit == 15 and governor.allowed == 100
    for _ in range(5):
        now = _window(governor, now + 2.0, 0.030)
        governor.tick(now, 20, backlog=False, batch=governor.batch_limit)
    assert governor.batch_limit == 0 and governor.allowed == 100
    # Under the target with nothing waiting, the lines' allowance comes back.
    now = _window(governor, now, 0.010)
    governor.tick(now, 20, backlog=False, batch=0)
    assert governor.batch_limit == 1


def test_a_standard_burst_beside_a_few_lines_cuts_the_standard_lane_too() -> None:
    """The third GPU rehearsal: 16 lines ran when a burst of standard work came; every cut went to the lines'
    allowance (already zero) while the standard lane doubled each window and the pace stayed 2-8x over its
    target for 25 s. Lines too few to take off what the cut asks leave the rest to the standard lane."""
    governor = PaceGovernor(ceiling=896, slack=1.3, floor=16, cooldown_s=2.0)
    now = _learn(governor, 0.006, running=0)
    governor.batch_allowed = 16
    now = _window(governor, now, 0.020)
    governor.tick(now, 44, backlog=True, batch=16)
    assert governor.batch_limit == 8 and governor.allowed == 22
    # Lines enough to take off what the cut asks: they alone are cut (the test above).
    now = _window(governor, now + 2.0, 0.008)
    governor.tick(now, 10, backlog=True, batch=8)
    assert governor.allowed == 22 and governor.batch_limit < 8


def test_too_few_outputs_say_nothing() -> None:
    governor = PaceGovernor(ceiling=100, slack=1.3, floor=4)
    _learn(governor, 0.010, running=20)
    governor.record([0.5] * (MIN_SAMPLES - 1))
    assert governor.tick(100.0, 20, backlog=True) == 40
    assert governor.pace_s == pytest.approx(0.010)


def test_without_the_engines_own_latencies_the_streams_outputs_time_the_pace() -> None:
    governor = PaceGovernor(ceiling=100, slack=1.3, floor=4)
    for stream in range(4):
        for i in range(MIN_SAMPLES + 1):
            at = i * 0.010
            governor.token(f"s{stream}", at)
            governor.token(f"s{stream}", at + 0.0001)  # a second output of the same step (role, usage): no gap
        governor.end(f"s{stream}")
    governor.tick(1.0, 10, backlog=False)
    assert governor.pace_s == pytest.approx(0.0099, abs=0.0002)
    governor.token("s0", 5.0)  # a stream that ended starts afresh: no gap across its end
    governor.token("s0", 5.01)
    assert governor._gaps == [pytest.approx(0.01)]


def test_a_burst_doubles_each_window_from_what_ran() -> None:
    governor = PaceGovernor(ceiling=1000, slack=1.3, floor=16)
    assert governor.limit == 16  # nothing ran yet
    governor.tick(0.5, 16, backlog=True)
    assert governor.limit == 32
    governor.tick(1.0, 32, backlog=True)
    assert governor.limit == 64


async def test_the_worker_holds_standard_jobs_past_the_limit_and_takes_premium_at_once(redis_url: str,
                                                                                      redis) -> None:
    engine = InstantEngine(tokens=200, token_delay_s=0.02)
    client = connect(redis_url)
    governor = PaceGovernor(ceiling=7, slack=1.3, floor=2, window_s=3600)  # no tick in this test: the floor holds
    info = WorkerInfo(worker_id="w-pace", model=POOL, max_model_len=engine.max_model_len, capacity=8,
                      engine="instant", started_ms=now_ms())
    loop = WorkerLoop(client, engine, info, premium_reserve=1, governor=governor)
    task = asyncio.create_task(loop.run())
    try:
        for i in range(4):
            await _queue(redis, _job(f"std{i}", {"model": POOL, "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True}), account_id=i + 1)
        await asyncio.sleep(1.0)
        running = {rid for rid, (_, _, job) in loop.entries.items() if job.lane is Lane.STANDARD}
        assert len(running) == 2, running  # the limit (its floor), though 6 standard slots are free
        await _queue(redis, _job("prem", lane=Lane.PREMIUM), account_id=99)
        replies = await _answered(redis, "prem")
        assert replies[-1].status in (0, 200)
        assert len({rid for rid, (_, _, job) in loop.entries.items() if job.lane is Lane.STANDARD}) <= 2
    finally:
        loop.stop()
        await asyncio.wait_for(task, 30)
        await client.aclose()


def test_the_admin_api_shows_a_workers_governor() -> None:
    from flatfare.gateway.admin.catalog_schemas import WorkerPublic

    governor = PaceGovernor(ceiling=100, slack=1.3, floor=4)
    info = WorkerInfo(worker_id="w", model=POOL, max_model_len=1, capacity=8, engine="vllm", started_ms=1,
                      extra={"governor": governor.state()})
    assert WorkerPublic.of(info).governor == {"limit": 4, "allowed": 100, "batch_limit": 4, "ceiling": 100,
                                              "pace_ms": None, "baseline_ms": None, "target_ms": None}
    assert WorkerPublic.of(WorkerInfo(worker_id="w", model=POOL, max_model_len=1, capacity=8, engine="vllm",
                                      started_ms=1)).governor is None

