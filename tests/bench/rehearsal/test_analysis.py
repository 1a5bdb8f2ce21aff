"""The rehearsal's figures (bench/rehearsal/analysis.py) from records made by hand: goodput counts only what
met the SLO, Premium's busy and quiet minutes are told apart, and each goal's verdict turns when its figure
does (a lost request, an audit fault, a premium 429, a slower busy minute)."""

from __future__ import annotations

from bench.rehearsal import analysis
from bench.rehearsal.analysis import Context, Slo
from bench.rehearsal.client import Record


def rec(index: int, rank: int, plan: str, ttft: float | None = 0.1, tpot: float | None = 0.02, status: int = 200,
        code: str = "", lost: bool = False, model: str = "main") -> Record:
    r = Record(index, rank, plan, model, 0.0, status=status, code=code, ttft_s=ttft, tpot_s=tpot, lost=lost)
    r.gaps = [tpot] * 3 if tpot is not None else []
    r.completion_tokens = 4 if status == 200 else 0
    return r


CTX = Context({i: (10 if i < 50 else 11) for i in range(100)}, {10: "quiet", 11: "busy"}, frozenset({1}), 30.0)


def _phase(records: list[Record]) -> dict:
    return {"groups": analysis.groups(records, CTX, Slo(), 60.0)}


def _records(busy_ttft: float = 0.1, busy_tpot: float = 0.02) -> list[Record]:
    records = [rec(i, 6, "premium") for i in range(10)]  # quiet minute, premium
    records += [rec(50 + i, 6, "premium", ttft=busy_ttft, tpot=busy_tpot) for i in range(10)]  # busy, premium
    records += [rec(20 + i, 30, "pro") for i in range(10)]
    records += [rec(60 + i, 1, "free", status=429, code="quota_exceeded", ttft=None, tpot=None) for i in range(5)]
    return records


def test_goodput_counts_only_what_met_the_slo() -> None:
    records = [rec(0, 30, "pro"), rec(1, 30, "pro", ttft=3.0), rec(2, 30, "pro", tpot=0.2),
               rec(3, 30, "pro", status=429, code="too_many_inflight", ttft=None), rec(4, 30, "pro", lost=True)]
    s = analysis.summary(records, Slo(2.0, 0.1), seconds=10.0)
    assert (s["sent"], s["answered"], s["good"], s["refused_429"], s["lost"]) == (5, 3, 1, 1, 1)
    assert s["goodput_rps"] == 0.1 and s["slo_attainment"] == 0.2
    assert s["codes"] == {"too_many_inflight": 1, "200": 1}


def test_busy_and_quiet_minutes_are_apart() -> None:
    g = analysis.groups(_records(busy_ttft=0.3), CTX, Slo(), 60.0)
    assert g["premium:quiet"]["sent"] == g["premium:busy"]["sent"] == 10
    assert g["premium:busy"]["ttft_p50_ms"] == 300 and g["premium:quiet"]["ttft_p50_ms"] == 100
    assert g["heavy_accounts"]["refused_429"] == 5 and g["quiet_accounts"]["refused_429"] == 0


def _verdict(goals: list[analysis.Goal], start: str) -> bool | None:
    return next(g.met for g in goals if g.name.startswith(start))


def test_each_verdict_turns_with_its_figure() -> None:
    good = analysis.verdicts({"full": _phase(_records())}, None, {"faults": []}, None)
    assert _verdict(good, "Premium TTFT p50") and _verdict(good, "Premium TPOT p50") and _verdict(good, "Requests lost")
    assert _verdict(good, "Money audit")
    slow = analysis.verdicts({"full": _phase(_records(busy_ttft=0.13, busy_tpot=0.031))}, None, None, None)
    assert _verdict(slow, "Premium TTFT p50") is False and _verdict(slow, "Premium TPOT p50") is False
    records = _records()
    records.append(rec(99, 6, "premium", status=429, code="queue_full", ttft=None))
    records.append(rec(98, 30, "pro", lost=True))
    bad = analysis.verdicts({"full": _phase(records)}, None, {"faults": ["1 request(s) billed twice"]}, None)
    assert _verdict(bad, "Premium 429s") is False and _verdict(bad, "Requests lost") is False
    assert _verdict(bad, "Money audit") is False


def test_goodput_against_vllm_and_the_quiet_accounts_and_batches() -> None:
    ours = _phase(_records())
    theirs = {"groups": analysis.groups([rec(i, 30, "pro", ttft=5.0) for i in range(30)], CTX, Slo(), 60.0)}
    alone = _phase([r for r in _records() if r.rank != 1])
    ours["batch"] = {"lines": 10, "completed": 7}
    goals = analysis.verdicts({"full": ours, "no-heavy": alone, "no-batch": _phase(_records())}, theirs, None, None,
                              admissible=(0.4, 0.0))
    assert _verdict(goals, "Goodput over the requests the plans admit") is True
    assert _verdict(goals, "Goodput over every request sent") is None  # shown, not judged
    behind = analysis.verdicts({"full": ours}, theirs, None, None, admissible=(0.4, 0.5))
    assert _verdict(behind, "Goodput over the requests the plans admit") is False
    assert _verdict(goals, "Quiet accounts' TTFT p50") is True
    assert _verdict(goals, "Live TTFT p99 with batch") is True and _verdict(goals, "Batch lines completed") is True


def test_resources_flat_or_not() -> None:
    samples = [{"x": 100.0}] * 5 + [{"x": 130.0}] * 5
    flat = analysis.flatness(samples, "x")
    assert flat == {"first": 100.0, "last": 130.0, "change": 0.3}
    goals = analysis.verdicts({}, None, None, {"memory": flat})
    assert _verdict(goals, "memory") is False


def test_batch_lines_by_the_minutes_they_completed_in() -> None:
    progress = [{"t": 0.5, "completed": 2}, {"t": 1.5, "completed": 5}, {"t": 5.0, "completed": 9}]
    assert analysis.batch_by_kind(progress, 10.0, 60.0, {10: "quiet", 11: "busy"}) == \
        {"quiet": 2, "busy": 3, "after": 4}


def test_goodput_over_the_requests_the_plans_admit() -> None:
    saved = [rec(i, 30, "pro").saved() for i in range(4)] + [rec(9, 1, "free", ttft=5.0).saved()]
    assert analysis.admissible_goodput(saved, {0, 1, 9}, Slo(), 2.0) == 1.0  # 0 and 1 good; 9 too late

