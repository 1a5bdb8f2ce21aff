"""The fleet's decisions (fleet/decisions.py), a pure function: every rule on small cases, then the
budget checked over many random ticks of a simulated host."""

from __future__ import annotations

import random

import pytest

from flatfare.contract import WorkerState
from flatfare.fleet.decisions import (
    BACKOFF_S,
    HOLDING,
    Act,
    Action,
    Budget,
    Engine,
    Failure,
    FleetModel,
    decide,
)

W = WorkerState
CPU1 = Budget(slots=("cpu",), max_awake=1)
CPU2 = Budget(slots=("cpu",), max_awake=2)
GPU2 = Budget(slots=("0", "1"), max_awake=2, host_memory_gb=100.0, gpu=True)
NOW = 1_000_000_000


def models(*specs: FleetModel | str) -> dict[str, FleetModel]:
    out = {}
    for spec in specs:
        model = FleetModel(spec) if isinstance(spec, str) else spec
        out[model.name] = model
    return out


def eng(worker_id: str, model: str, state: WorkerState = W.WARM, **kw: object) -> Engine:
    return Engine(worker_id, model, state, **kw)  # type: ignore[arg-type]


def acts(plan: object) -> list[tuple[str, str, str]]:
    return [(a.act.value, a.model, a.worker_id) for a in plan.actions]  # type: ignore[attr-defined]


# -- starting and waking ---------------------------------------------------------------------------

def test_demand_starts_a_model_with_no_engine() -> None:
    plan = decide(models("a"), {"a": 1}, [], CPU1, NOW)
    assert acts(plan) == [("start", "a", "")]
    assert plan.waiting == {}


def test_no_demand_starts_nothing_and_a_pinned_model_starts_without_demand() -> None:
    assert decide(models("a"), {}, [], CPU1, NOW).actions == []
    plan = decide(models(FleetModel("p", keep=1)), {}, [], CPU1, NOW)
    assert acts(plan) == [("start", "p", "")]


def test_min_workers_start_that_many_within_the_budget() -> None:
    plan = decide(models(FleetModel("p", keep=3)), {}, [], CPU2, NOW)
    assert acts(plan) == [("start", "p", ""), ("start", "p", "")]
    assert "no free engine slot" in plan.waiting["p"]


def test_a_serving_engine_anywhere_answers_the_demand() -> None:
    for state in (W.WARM, W.STARTING, W.WAKING):
        assert decide(models("a"), {"a": 5}, [eng("w1", "a", state)], CPU2, NOW).actions == []
    # Another fleet's (or a hand-started) worker serves the queue too, and never counts against this budget.
    assert decide(models("a"), {"a": 5}, [eng("x", "a", own=False)], CPU2, NOW).actions == []
    plan = decide(models("a", "b"), {"b": 1}, [eng("x", "a", own=False), eng("y", "a", own=False)], CPU1, NOW)
    assert acts(plan) == [("start", "b", "")]


def test_an_asleep_engine_is_woken_rather_than_a_new_one_started() -> None:
    asleep = eng("w1", "a", W.ASLEEP, slots=("0",), sleep_level=1)
    plan = decide(models("a"), {"a": 1}, [asleep], GPU2, NOW)
    assert acts(plan) == [("wake", "a", "w1")]


def test_the_level_1_sleeper_is_woken_first() -> None:
    engines = [eng("deep", "a", W.ASLEEP, slots=("0",), sleep_level=2, last_used_ms=NOW),
               eng("light", "a", W.ASLEEP, slots=("1",), sleep_level=1, last_used_ms=NOW - 10)]
    assert acts(decide(models("a"), {"a": 1}, engines, GPU2, NOW)) == [("wake", "a", "light")]


def test_an_engine_going_to_sleep_is_waited_for_not_duplicated() -> None:
    plan = decide(models("a"), {"a": 1}, [eng("w1", "a", W.SLEEPING, slots=("0",))], GPU2, NOW)
    assert plan.actions == []
    assert "going to sleep" in plan.waiting["a"]


def test_a_start_gets_free_gpus_and_as_many_as_its_parallel_size() -> None:
    busy = eng("w1", "a", W.WARM, slots=("0",), inflight=1)
    plan = decide(models("a", "b"), {"a": 1, "b": 1}, [busy], GPU2, NOW)
    assert [(a.act, a.model, a.slots) for a in plan.actions] == [(Act.START, "b", ("1",))]
    big = FleetModel("big", slots=2)
    plan = decide(models(big), {"big": 1}, [], GPU2, NOW)
    assert plan.actions[0].slots == ("0", "1")


# -- several engines on one GPU ----------------------------------------------------------------------

GPU1 = Budget(slots=("0",), max_awake=2, host_memory_gb=100.0, gpu=True)


def test_engines_whose_shares_fit_share_a_gpu_both_awake() -> None:
    big, small = FleetModel("big", keep=1, gpu_share=0.62), FleetModel("small", gpu_share=0.3)
    busy = eng("w0", "big", slots=("0",), inflight=40)
    plan = decide(models(big, small), {"big": 40, "small": 1}, [busy], GPU1, NOW)
    assert [(a.act, a.model, a.slots) for a in plan.actions] == [(Act.START, "small", ("0",))]
    # Asleep, the small one wakes beside the busy one without putting it away.
    asleep = eng("w1", "small", W.ASLEEP, slots=("0",), sleep_level=1)
    plan = decide(models(big, small), {"big": 40, "small": 1}, [busy, asleep], GPU1, NOW)
    assert acts(plan) == [("wake", "small", "w1")]


def test_an_engine_without_a_share_takes_the_whole_gpu() -> None:
    big, whole = FleetModel("big", keep=1, gpu_share=0.62), FleetModel("whole")
    plan = decide(models(big, whole), {"big": 4, "whole": 1}, [eng("w0", "big", slots=("0",), inflight=4)], GPU1, NOW)
    assert plan.actions == []
    assert plan.waiting["whole"] == "no free GPU: whole needs 1, 0 free (busy serving big)"


def test_a_share_that_does_not_fit_puts_the_idle_sharer_away_not_the_busy_one() -> None:
    big, small, other = (FleetModel("big", keep=1, gpu_share=0.62), FleetModel("small", gpu_share=0.3),
                         FleetModel("other", gpu_share=0.3))
    engines = [eng("w0", "big", slots=("0",), inflight=40, last_used_ms=0),
               eng("w1", "small", slots=("0",), last_used_ms=NOW - 10_000)]
    plan = decide(models(big, small, other), {"big": 40, "other": 1}, engines, GPU1, NOW)
    assert [(a.act, a.worker_id) for a in plan.actions] == [(Act.SLEEP, "w1")]
    assert plan.waiting["other"] == "waiting for small to sleep"
    engines[1] = eng("w1", "small", W.ASLEEP, slots=("0",), sleep_level=1)
    plan = decide(models(big, small, other), {"big": 40, "other": 1}, engines, GPU1, NOW + 1_000)
    assert [(a.act, a.model, a.slots) for a in plan.actions] == [(Act.START, "other", ("0",))]


# -- the budget, least recently used first -----------------------------------------------------------

def test_a_full_budget_stops_the_least_recently_used_idle_engine_first_on_cpu() -> None:
    engines = [eng("old", "a", last_used_ms=NOW - 50_000), eng("new", "b", last_used_ms=NOW - 1_000)]
    plan = decide(models("a", "b", "c"), {"c": 1}, engines, CPU2, NOW)
    assert acts(plan) == [("stop", "a", "old")]
    assert plan.waiting["c"] == "waiting for a to stop"


def test_on_a_gpu_the_evicted_engine_sleeps_and_the_model_starts_once_it_let_go() -> None:
    engines = [eng("w0", "a", slots=("0",), last_used_ms=NOW - 9_000),
               eng("w1", "b", slots=("1",), last_used_ms=NOW - 1_000)]
    plan = decide(models("a", "b", "c"), {"c": 1}, engines, GPU2, NOW)
    assert [(a.act, a.worker_id, a.level) for a in plan.actions] == [(Act.SLEEP, "w0", 1)]
    # Next tick: w0 is going to sleep, still holding GPU 0: nothing more is evicted, nothing starts.
    engines[0] = eng("w0", "a", W.SLEEPING, slots=("0",), sleep_level=1)
    plan = decide(models("a", "b", "c"), {"c": 1}, engines, GPU2, NOW + 500)
    assert plan.actions == [] and plan.waiting["c"] == "waiting for a to sleep"
    # Asleep: GPU 0 is free again.
    engines[0] = eng("w0", "a", W.ASLEEP, slots=("0",), sleep_level=1)
    plan = decide(models("a", "b", "c"), {"c": 1}, engines, GPU2, NOW + 1_000)
    assert [(a.act, a.model, a.slots) for a in plan.actions] == [(Act.START, "c", ("0",))]


def test_busy_engines_and_engines_with_demand_are_never_evicted() -> None:
    engines = [eng("busy", "a", inflight=1, last_used_ms=0), eng("asked", "b", last_used_ms=0)]
    plan = decide(models("a", "b", "c"), {"b": 2, "c": 1}, engines, CPU2, NOW)
    assert plan.actions == []
    assert plan.waiting["c"] == "no free engine slot: 2 of 2 busy serving a, b"


def test_pinned_engines_are_never_evicted_but_one_beyond_the_pin_is() -> None:
    pinned = FleetModel("p", keep=1)
    plan = decide(models(pinned, "c"), {"c": 1}, [eng("w1", "p", last_used_ms=0)], CPU1, NOW)
    assert plan.actions == [] and "no free engine slot" in plan.waiting["c"]
    engines = [eng("w1", "p", last_used_ms=NOW - 5), eng("w2", "p", last_used_ms=NOW - 100_000)]
    plan = decide(models(pinned, "c"), {"c": 1}, engines, CPU2, NOW)
    assert acts(plan) == [("stop", "p", "w2")]


def test_engines_starting_waking_draining_or_going_to_sleep_hold_their_slot() -> None:
    for state in (W.STARTING, W.WAKING, W.DRAINING, W.SLEEPING):
        plan = decide(models("a", "b"), {"b": 1}, [eng("w1", "a", state)], CPU1, NOW)
        assert not [a for a in plan.actions if a.act in (Act.START, Act.WAKE)], state
    assert state in HOLDING


def test_one_leaving_engine_is_counted_on_by_one_waiting_model_only() -> None:
    engines = [eng("leaving", "a", W.DRAINING), eng("idle", "b", last_used_ms=NOW - 1)]
    plan = decide(models("a", "b", "c", "d"), {"c": 2, "d": 1}, engines, CPU2, NOW)
    # c (more queued) counts on the draining engine; d has the idle one stopped for it.
    assert acts(plan) == [("stop", "b", "idle")]
    assert plan.waiting == {"c": "waiting for a to stop", "d": "waiting for b to stop"}


def test_a_wake_counts_against_the_budget_and_needs_its_own_gpu() -> None:
    asleep = eng("s", "a", W.ASLEEP, slots=("0",), sleep_level=1)
    busy = eng("w", "b", slots=("0",), inflight=2)
    gpu = Budget(slots=("0", "1"), max_awake=2, host_memory_gb=100.0, gpu=True)
    plan = decide(models("a", "b"), {"a": 1}, [asleep, busy], gpu, NOW)
    # GPU 0 is busy serving b: a fresh engine of a starts on GPU 1 rather than waiting.
    assert [(a.act, a.slots) for a in plan.actions] == [(Act.START, ("1",))]


# -- idle timeouts -------------------------------------------------------------------------------

def test_an_idle_engine_stops_after_its_models_timeout_not_before() -> None:
    quick = FleetModel("a", idle_timeout_s=60)
    assert decide(models(quick), {}, [eng("w", "a", last_used_ms=NOW - 59_000)], CPU1, NOW).actions == []
    plan = decide(models(quick), {}, [eng("w", "a", last_used_ms=NOW - 60_000)], CPU1, NOW)
    assert acts(plan) == [("stop", "a", "w")] and "idle for 60 s" in plan.actions[0].why
    # Busy, or with demand, it is not idle however long ago it was last used.
    assert decide(models(quick), {}, [eng("w", "a", inflight=1, last_used_ms=0)], CPU1, NOW).actions == []
    assert decide(models(quick), {"a": 1}, [eng("w", "a", last_used_ms=0)], CPU1, NOW).actions == []


def test_a_pinned_engine_never_times_out_and_gpu_engines_sleep_instead() -> None:
    pinned = FleetModel("p", keep=1, idle_timeout_s=1)
    assert decide(models(pinned), {}, [eng("w", "p", last_used_ms=0)], CPU1, NOW).actions == []
    plan = decide(models(FleetModel("a", idle_timeout_s=1)), {}, [eng("w", "a", slots=("0",))], GPU2, NOW)
    assert [(a.act, a.level) for a in plan.actions] == [(Act.SLEEP, 1)]


# -- sleep levels ----------------------------------------------------------------------------------

def test_level_1_while_the_sleepers_weights_fit_host_memory_then_level_2() -> None:
    budget = Budget(slots=("0", "1", "2"), max_awake=3, host_memory_gb=40.0, gpu=True)
    catalog = models(*(FleetModel(n, idle_timeout_s=1, weights_gb=16.0) for n in "abcd"))
    asleep = eng("sa", "a", W.ASLEEP, slots=("0",), sleep_level=1)
    engines = [asleep, eng("wb", "b", slots=("0",)), eng("wc", "c", slots=("1",)), eng("wd", "d", slots=("2",))]
    plan = decide(catalog, {}, engines, budget, NOW)
    # 16 GiB already asleep at level 1: one more fits 40 GiB (32), the next would not (48).
    assert [(a.worker_id, a.level) for a in plan.actions] == [("wb", 1), ("wc", 2), ("wd", 2)]
    # A level-2 sleeper keeps nothing in host memory.
    engines[0] = eng("sa", "a", W.ASLEEP, slots=("0",), sleep_level=2)
    plan = decide(catalog, {}, engines, budget, NOW)
    assert [a.level for a in plan.actions] == [1, 1, 2]


def test_an_engine_of_unknown_size_sleeps_at_level_1_within_a_zero_budget_only_if_weightless() -> None:
    budget = Budget(slots=("0",), max_awake=1, host_memory_gb=0.0, gpu=True)
    assert decide(models(FleetModel("a", idle_timeout_s=1)), {}, [eng("w", "a", slots=("0",))], budget,
                  NOW).actions[0].level == 1
    assert decide(models(FleetModel("a", idle_timeout_s=1, weights_gb=0.5)), {}, [eng("w", "a", slots=("0",))],
                  budget, NOW).actions[0].level == 2


# -- failures and catalog changes ------------------------------------------------------------------

def test_a_failed_start_is_retried_after_a_doubling_backoff_and_says_why() -> None:
    once = Failure(1, NOW, "CUDA out of memory")
    plan = decide(models("a"), {"a": 1}, [], CPU1, NOW + 1_000, {"a": once})
    assert plan.actions == [] and "retrying in" in plan.waiting["a"]
    assert acts(decide(models("a"), {"a": 1}, [], CPU1, NOW + int(BACKOFF_S * 1000), {"a": once})) == \
        [("start", "a", "")]
    thrice = Failure(3, NOW, "CUDA out of memory")
    plan = decide(models("a"), {"a": 1}, [], CPU1, NOW + int(BACKOFF_S * 2000), {"a": thrice})
    assert plan.actions == []
    assert plan.waiting["a"].startswith("the start failed (3 time(s)): CUDA out of memory")
    # Not needed any more (no demand, not pinned): not restarted, and no reason to wait.
    plan = decide(models("a"), {}, [], CPU1, NOW + 10**9, {"a": thrice})
    assert plan.actions == [] and plan.waiting == {}


def test_engines_of_a_model_no_longer_served_stop_asleep_or_not() -> None:
    engines = [eng("w1", "gone", last_used_ms=NOW), eng("w2", "gone", W.ASLEEP, slots=("0",), sleep_level=1),
               eng("w3", "gone", W.DRAINING)]
    plan = decide(models("a"), {}, engines, GPU2, NOW)
    assert acts(plan) == [("stop", "gone", "w1"), ("stop", "gone", "w2")]


# -- Batch API lines: idle capacity only -------------------------------------------------------------

def test_batch_lines_alone_start_a_model_where_there_is_room() -> None:
    plan = decide(models("a"), {}, [], CPU1, NOW, batch_demand={"a": 5})
    assert plan.actions == [Action(Act.START, "a", "5 batch line(s) queued, on idle capacity")]


def test_batch_lines_never_put_another_engine_away() -> None:
    idle_b = [eng("w", "b", last_used_ms=NOW - 1_000)]
    plan = decide(models("a", "b"), {}, idle_b, CPU1, NOW, batch_demand={"a": 3})
    assert plan.actions == [] and plan.waiting == {"a": "batch lines wait for an idle engine slot"}
    # A live request for it does.
    assert acts(decide(models("a", "b"), {"a": 1}, idle_b, CPU1, NOW, batch_demand={"a": 3})) == [("stop", "b", "w")]


def test_an_engine_with_batch_lines_left_does_not_time_out() -> None:
    quick = FleetModel("a", idle_timeout_s=60)
    old = [eng("w", "a", last_used_ms=NOW - 600_000)]
    assert decide(models(quick), {}, old, CPU1, NOW, batch_demand={"a": 2}).actions == []
    assert acts(decide(models(quick), {}, old, CPU1, NOW)) == [("stop", "a", "w")]


def test_live_demand_puts_away_an_engine_busy_with_batch_lines_only() -> None:
    batching = [eng("w", "a", inflight=4, last_used_ms=NOW)]
    plan = decide(models("a", "b"), {"b": 1}, batching, CPU1, NOW, batch_demand={"a": 40})
    assert acts(plan) == [("stop", "a", "w")] and plan.waiting["b"] == "waiting for a to stop"
    # Its jobs in flight are live ones (counted in its live demand): it stays.
    plan = decide(models("a", "b"), {"a": 4, "b": 1}, batching, CPU1, NOW, batch_demand={"a": 40})
    assert plan.actions == []


# -- the budget over many random ticks ---------------------------------------------------------------

def _simulate(budget: Budget, seed: int, shares: tuple[float, ...] = (1.0,)) -> None:
    """A host whose engines move one step a tick (starting -> warm, sleeping -> asleep, draining ->
    gone, waking -> warm) under random demand; the engines holding an accelerator never exceed the
    budget, pinned models are never put away, and no GPU holds engines whose shares add up past one
    (with whole-GPU shares: no GPU is held by two engines)."""
    rng = random.Random(seed)
    catalog = models(FleetModel("p", keep=1, idle_timeout_s=5, gpu_share=rng.choice(shares)),
                     *(FleetModel(n, idle_timeout_s=rng.choice([2, 5, 30]), weights_gb=rng.choice([0.5, 8.0, 30.0]),
                                  gpu_share=rng.choice(shares)) for n in "abcde"))
    engines: dict[str, Engine] = {}
    now = NOW
    serial = 0
    for _ in range(400):
        now += 1000
        demand = {m: rng.choice([0, 0, 0, 1, 3]) for m in catalog}
        lines = {m: rng.choice([0, 0, 0, 0, 20]) for m in catalog}
        moved = {}
        for e in engines.values():
            nxt = {W.STARTING: W.WARM, W.WAKING: W.WARM, W.SLEEPING: W.ASLEEP}.get(e.state, e.state)
            if e.state is W.DRAINING:
                continue
            used = now if (nxt is W.WARM and demand[e.model]) else e.last_used_ms
            inflight = rng.choice([0, 1]) if nxt is W.WARM and demand[e.model] else 0
            moved[e.worker_id] = Engine(e.worker_id, e.model, nxt, e.slots, used, inflight, e.sleep_level)
        engines = moved
        plan = decide(catalog, demand, list(engines.values()), budget, now, batch_demand=lines)
        for a in plan.actions:
            if a.act is Act.START:
                serial += 1
                engines[f"w{serial}"] = Engine(f"w{serial}", a.model, W.STARTING, a.slots, now)
            else:
                e = engines[a.worker_id]
                assert not (a.act in (Act.SLEEP, Act.STOP) and e.model == "p" and
                            sum(1 for x in engines.values() if x.model == "p" and x.state in HOLDING) <= 1), a
                state = {Act.WAKE: W.WAKING, Act.SLEEP: W.SLEEPING, Act.STOP: W.DRAINING}[a.act]
                engines[a.worker_id] = Engine(e.worker_id, e.model, state, e.slots, e.last_used_ms, e.inflight,
                                              a.level or e.sleep_level)
        holding = [e for e in engines.values() if e.state in HOLDING]
        assert len(holding) <= budget.max_awake, (plan, holding)
        if budget.gpu:
            used: dict[str, float] = {}
            for e in holding:
                for slot in e.slots:
                    used[slot] = used.get(slot, 0.0) + catalog[e.model].gpu_share
            assert all(u <= 1.0 + 1e-6 for u in used.values()), holding
            level1 = sum(catalog[e.model].weights_gb for e in engines.values()
                         if e.state in (W.ASLEEP, W.SLEEPING) and e.sleep_level == 1)
            assert level1 <= budget.host_memory_gb + max(m.weights_gb for m in catalog.values())


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("budget", [CPU1, CPU2, GPU2, Budget(("0", "1", "2", "3"), 3, 40.0, gpu=True)],
                         ids=["cpu1", "cpu2", "gpu2", "gpu4-3awake"])
def test_the_budget_is_never_exceeded(budget: Budget, seed: int) -> None:
    _simulate(budget, seed)


@pytest.mark.parametrize("seed", range(20))
def test_gpu_shares_are_never_exceeded(seed: int) -> None:
    _simulate(Budget(("0", "1"), 4, 40.0, gpu=True), seed, shares=(0.3, 0.45, 0.62, 1.0))


def test_an_action_says_why() -> None:
    plan = decide(models("a"), {"a": 2}, [], CPU1, NOW)
    assert plan.actions == [Action(Act.START, "a", "2 request(s) queued")]
