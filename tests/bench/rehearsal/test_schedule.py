"""The rehearsal's schedule (bench/rehearsal/schedule.py): the trace as published, the stated account rule,
the same requests at the same moments whatever a phase leaves out, the plans' quotas in the engine's load,
the busy and quiet minutes, and a sample that loads the busiest minute as asked."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.rehearsal import schedule
from bench.rehearsal.schedule import Window


@pytest.fixture(scope="module")
def trace() -> list[schedule.TraceRequest]:
    return schedule.load()


def test_the_trace_is_the_published_hour(trace: list[schedule.TraceRequest]) -> None:
    assert len(trace) == 19_366
    assert trace[0].at_s == 0 and 3_501 < trace[-1].at_s < 3_502
    assert sorted(r.prompt_tokens for r in trace)[len(trace) // 2] == 1_020
    assert sorted(r.output_tokens for r in trace)[len(trace) // 2] == 129


def test_the_account_rule() -> None:
    book = schedule.accounts(300)
    assert {r: book[r].plan for r in (1, 2, 3, 4)} == {1: "free", 2: "pro", 3: "free", 4: "pro"}
    assert all(book[r].heavy for r in (1, 2, 3, 4)) and not book[5].heavy
    assert [r for r, a in book.items() if a.plan == "premium"] == [6, 9, 12, 15, 18, 21, 24]
    assert [r for r, a in book.items() if a.plan == "enterprise"] == [8]
    assert {book[r].lane for r in (6, 8)} == {"premium"} and book[2].lane == "standard"
    assert [r for r, a in book.items() if a.model == schedule.SECOND][:3] == [40, 65, 90]
    assert {book[r].plan for r in (11, 13, 17, 40)} == {"pro"}
    assert book[35].plan == "trial" and book[30].plan == "pro" and book[31].plan == "free"


def test_the_same_window_sends_the_same_requests(trace: list[schedule.TraceRequest]) -> None:
    window = Window(24, 30, 0.3, 17)
    first, again = schedule.build(trace, window), schedule.build(trace, window)
    assert first == again and first
    assert all(0 <= s.at_s < window.duration_s for s in first)
    assert [s.at_s for s in first] == sorted(s.at_s for s in first)
    # Batch lines go to the batch accounts; live requests to every rank, the heaviest most.
    assert {s.rank for s in first if s.batch} <= set(schedule.BATCH_ACCOUNTS)
    live = Counter(s.rank for s in first if not s.batch)
    assert live.most_common(1)[0][0] == 1
    # A larger sample keeps every request a smaller one kept, with the same account.
    more = {(s.minute, s.at_s, s.rank) for s in schedule.build(trace, Window(24, 30, 0.6, 17))}
    assert {(s.minute, s.at_s, s.rank) for s in first} <= more


def test_the_engine_load_leaves_out_what_the_plans_refuse(trace: list[schedule.TraceRequest]) -> None:
    book = schedule.accounts(300)
    sends = schedule.build(trace, Window(0, 58, 1.0, 17))
    load = schedule.engine_load(sends, book)
    per_account = Counter(s.rank for s in load)
    assert per_account[1] == per_account[3] == 60  # the heaviest Free accounts: their daily quota
    assert per_account[2] == 1000
    assert not any(s.batch or book[s.rank].model == schedule.SECOND for s in load)
    assert not any(book[s.rank].plan == "free" and s.prompt_tokens > 4096 for s in load)


def test_minutes_are_busy_quiet_or_middle_by_load() -> None:
    rates = {m: float(m) for m in range(10, 18)}
    kinds = schedule.classify(rates)
    assert [m for m, k in kinds.items() if k == "busy"] == [16, 17]
    assert [m for m, k in kinds.items() if k == "quiet"] == [10, 11]


def test_the_sample_loads_the_busiest_minute_as_asked(trace: list[schedule.TraceRequest]) -> None:
    window = Window(24, 58, 1.0, 17)
    book = schedule.accounts(300)
    sample = schedule.sample_for(trace, window, 20.0, 1.4)
    assert 0 < sample < 1
    rates = schedule.per_minute(schedule.engine_load(schedule.build(trace, Window(24, 58, sample, 17)), book),
                                window)
    assert max(rates.values()) == pytest.approx(28.0, rel=0.1)
    assert schedule.sample_for(trace, window, 10_000.0, 1.4) == 1.0


def test_the_platforms_own_plans_replace_the_seeded_ones(trace: list[schedule.TraceRequest]) -> None:
    book = schedule.accounts(300)
    sends = schedule.build(trace, Window(0, 58, 1.0, 17))
    plans = {name: dict(limits) for name, limits in schedule.SEEDED.items()}
    plans["free"]["daily_limit"] = 10
    assert Counter(s.rank for s in schedule.engine_load(sends, book, plans))[1] == 10


def test_each_phase_leaves_out_what_it_says() -> None:
    import argparse

    from bench.rehearsal import Scheduled, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["run", "--out", "x.json", "--window", "24", "30"])
    sched = Scheduled(args, 0.3, {})
    full, heavy, batch = sched.phase("full"), sched.phase("no-heavy"), sched.phase("no-batch")
    assert full == sched.sends and any(s.batch for s in full) and any(sched.book[s.rank].heavy for s in full)
    assert heavy == [s for s in full if s.rank not in schedule.HEAVY]
    assert batch == [s for s in full if not s.batch]
