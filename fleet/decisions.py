"""The fleet's decisions: what to start, wake, put to sleep or stop, as a pure function of what the
supervisor knows at one moment (its models, their queued demand, the engines, its budget, the time).

:func:`decide` reads nothing and changes nothing; :mod:`flatfare.fleet.supervisor` gathers its inputs
from Redis, the catalog and its child processes, and carries its actions out. The rules:

- An engine holds its accelerator from the moment it starts until it is asleep or has exited:
  starting, waking, warm, draining and going to sleep all count against ``max_awake`` (and, on a GPU
  host, hold their GPUs), so the budget is never exceeded even while engines change state.
- On a GPU host an engine holds ``gpu_share`` of each of its GPUs (its entry's
  ``gpu_memory_utilization``; a whole GPU where the entry sets none): engines whose shares add up to at
  most one share a GPU, both awake (a small model beside a large one), within ``max_awake``.
- A model with queued requests and no engine serving (warm, starting or waking, this fleet's or
  another's) gets one: its asleep engine is woken, else a new one starts. A model kept up (pinned, or
  ``min_workers``) gets that many engines of this fleet whatever the demand.
- No room: the least recently used idle engine (warm, no job, no demand, not one a kept model needs)
  is put to sleep (GPU) or stopped (CPU); the model starts once it has let go. An engine already on
  its way out is waited for rather than evicting another.
- An idle engine past its model's idle timeout sleeps (GPU) or stops (CPU), unless its model keeps it.
- Batch API lines (``batch_demand``) use idle capacity only: a model with batch lines and no engine
  gets one where there is room without evicting anything; its engine does not time out while lines
  remain, but live demand for another model may put it away (its lines wait, they are not lost).
- A sleeper keeps its weights in host memory (level 1) while the level-1 sleepers' weights fit
  ``host_memory_gb``; beyond that it drops them (level 2) and reloads them when woken.
- A start that failed is tried again only after a backoff that doubles with each failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from flatfare.contract import WorkerState

# States in which an engine holds its accelerator (memory, compute): until ASLEEP or exited.
HOLDING = frozenset({WorkerState.STARTING, WorkerState.WAKING, WorkerState.WARM, WorkerState.DRAINING,
                     WorkerState.SLEEPING})
# States in which an engine serves its model's queue now or shortly.
SERVING = frozenset({WorkerState.STARTING, WorkerState.WAKING, WorkerState.WARM})
# Backoff after a failed start: the first retry after this long, doubling up to BACKOFF_MAX_S.
BACKOFF_S = 5.0
BACKOFF_MAX_S = 120.0
# From this many failed starts in a row, a model's waiting reason says the start fails.
FAILED_STARTS_SHOWN = 2
# Rounding room when GPU shares add up (0.7 + 0.3 fits one GPU).
SHARE_SLACK = 1e-6


class Act(StrEnum):
    START = "start"
    WAKE = "wake"
    SLEEP = "sleep"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class FleetModel:
    """A catalog model as this fleet serves it."""

    name: str
    # Engines of this fleet kept up whatever the demand (pinned: at least 1; min_workers).
    keep: int = 0
    idle_timeout_s: float = 300.0
    # Accelerator slots one engine needs (GPUs: tensor x pipeline parallel size); 1 on a CPU host.
    slots: int = 1
    # Its weights' size, for the host memory that level-1 sleepers use.
    weights_gb: float = 0.0
    # The share of each of its GPUs' memory one engine takes (vLLM's gpu_memory_utilization); 1.0: whole GPUs.
    gpu_share: float = 1.0


@dataclass(frozen=True, slots=True)
class Engine:
    worker_id: str
    model: str
    state: WorkerState
    slots: tuple[str, ...] = ()
    # When it last took or finished a job, or became warm (ms): the least recently used goes first.
    last_used_ms: int = 0
    inflight: int = 0
    # The level it sleeps at, or is going to sleep at (0: awake).
    sleep_level: int = 0
    # Started by this fleet; another's (or a worker started by hand) counts only as serving its model.
    own: bool = True


@dataclass(frozen=True, slots=True)
class Budget:
    # GPU ids, or ("cpu",) on a CPU host.
    slots: tuple[str, ...]
    max_awake: int
    host_memory_gb: float = 0.0
    # On a GPU host engines sleep and hold their own GPUs; on a CPU host they share the cores and stop.
    gpu: bool = False


@dataclass(frozen=True, slots=True)
class Failure:
    """A model's failed starts in a row, the last one's time (ms) and why it failed."""

    count: int
    last_ms: int
    reason: str

    def retry_at_ms(self) -> int:
        return self.last_ms + int(min(BACKOFF_S * 2 ** (self.count - 1), BACKOFF_MAX_S) * 1000)


@dataclass(frozen=True, slots=True)
class Action:
    act: Act
    model: str
    why: str
    worker_id: str = ""
    # START: the slots it gets (GPU ids; () on a CPU host).
    slots: tuple[str, ...] = ()
    # SLEEP: vLLM's sleep level.
    level: int = 0


@dataclass(slots=True)
class Plan:
    actions: list[Action] = field(default_factory=list)
    # Models with demand that get no engine now -> why (FleetStatus.waiting).
    waiting: dict[str, str] = field(default_factory=dict)


class _Tick:
    """One decision's working state: the engines as the actions so far leave them."""

    def __init__(self, models: Mapping[str, FleetModel], demand: Mapping[str, int], engines: Sequence[Engine],
                 budget: Budget, now_ms: int, batch_demand: Mapping[str, int] | None = None) -> None:
        self.models = models
        self.demand = demand
        self.batch_demand = batch_demand or {}
        self.budget = budget
        self.now_ms = now_ms
        self.state = {e.worker_id: e.state for e in engines}
        self.engines = {e.worker_id: e for e in engines}
        # Engines on their way out whose release a waiting model already counts on.
        self.claimed: set[str] = set()
        self.plan = Plan()

    def own(self, model: str | None = None, states: Iterable[WorkerState] | None = None) -> list[Engine]:
        wanted = None if states is None else set(states)
        return [e for e in self.engines.values() if e.own and (model is None or e.model == model)
                and (wanted is None or self.state[e.worker_id] in wanted)]

    def holding(self) -> list[Engine]:
        return self.own(states=HOLDING)

    def share(self, engine: Engine) -> float:
        model = self.models.get(engine.model)
        return model.gpu_share if model is not None else 1.0

    def free_slots(self, share: float = 1.0, without: Iterable[Engine] = ()) -> list[str]:
        """The GPUs with room for an engine taking ``share`` of each, were the engines ``without`` gone (on a
        CPU host, its one slot, always)."""
        if not self.budget.gpu:
            return list(self.budget.slots)
        gone = {e.worker_id for e in without}
        used: dict[str, float] = {}
        for engine in self.holding():
            if engine.worker_id not in gone:
                for slot in engine.slots:
                    used[slot] = used.get(slot, 0.0) + self.share(engine)
        return [s for s in self.budget.slots if used.get(s, 0.0) + share <= 1.0 + SHARE_SLACK]

    def serving(self, model: str) -> int:
        return sum(1 for e in self.engines.values() if e.model == model and self.state[e.worker_id] in SERVING)

    def kept(self, engine: Engine) -> bool:
        """Whether its model's keep count needs this engine (the most recently used are kept)."""
        model = self.models.get(engine.model)
        if model is None or model.keep == 0:
            return False
        serving = sorted(self.own(engine.model, SERVING), key=lambda e: e.last_used_ms, reverse=True)
        return engine in serving[:model.keep]

    def idle(self, engine: Engine) -> bool:
        """Warm with no live work: no live demand (which counts the live jobs it holds) and nothing in
        flight, or only Batch API lines (which wait for it, or another engine, when it goes)."""
        return (self.state[engine.worker_id] is WorkerState.WARM and self.demand.get(engine.model, 0) == 0
                and (engine.inflight == 0 or self.batch_demand.get(engine.model, 0) > 0))

    def evictable(self) -> list[Engine]:
        """Idle engines no kept model needs, least recently used first."""
        return sorted((e for e in self.own(states=[WorkerState.WARM]) if self.idle(e) and not self.kept(e)),
                      key=lambda e: (e.last_used_ms, e.worker_id))

    def leaving(self) -> list[Engine]:
        """Engines on their way out (going to sleep, or draining to stop) nobody counts on yet."""
        return [e for e in self.own(states=[WorkerState.SLEEPING, WorkerState.DRAINING])
                if e.worker_id not in self.claimed]

    def act(self, action: Action) -> None:
        self.plan.actions.append(action)
        if action.act is Act.SLEEP:
            self.state[action.worker_id] = WorkerState.SLEEPING
        elif action.act is Act.STOP:
            self.state[action.worker_id] = WorkerState.DRAINING
        elif action.act is Act.WAKE:
            self.state[action.worker_id] = WorkerState.WAKING
        else:
            placeholder = Engine(f"(new {action.model} {len(self.plan.actions)})", action.model,
                                 WorkerState.STARTING, action.slots, self.now_ms)
            self.engines[placeholder.worker_id] = placeholder
            self.state[placeholder.worker_id] = WorkerState.STARTING

    def release(self, engine: Engine, why: str) -> None:
        """Sleep (GPU) or stop (CPU) ``engine``."""
        if self.budget.gpu:
            self.act(Action(Act.SLEEP, engine.model, why, engine.worker_id, level=self.sleep_level(engine.model)))
        else:
            self.act(Action(Act.STOP, engine.model, why, engine.worker_id))

    def sleep_level(self, model: str) -> int:
        """1 while the level-1 sleepers' weights and this model's fit the host memory budget, else 2."""
        used = sum(self._weights(e.model) for e in self.own(states=[WorkerState.ASLEEP, WorkerState.SLEEPING])
                   if self._level(e) == 1)
        return 1 if used + self._weights(model) <= self.budget.host_memory_gb else 2

    def _level(self, engine: Engine) -> int:
        # An engine this tick put to sleep: the level of its action.
        for action in self.plan.actions:
            if action.worker_id == engine.worker_id and action.act is Act.SLEEP:
                return action.level
        return engine.sleep_level

    def _weights(self, model: str) -> float:
        entry = self.models.get(model)
        return entry.weights_gb if entry else 0.0


def decide(models: Mapping[str, FleetModel], demand: Mapping[str, int], engines: Sequence[Engine],
           budget: Budget, now_ms: int, failures: Mapping[str, Failure] | None = None,
           batch_demand: Mapping[str, int] | None = None) -> Plan:
    """What to do now. ``demand``: live jobs queued or running per model; ``batch_demand``: Batch API
    lines queued or running per model; ``engines``: every live engine of the models' pools (this
    fleet's children with the state they are in or were just told to go to)."""
    tick = _Tick(models, demand, engines, budget, now_ms, batch_demand)
    failures = failures or {}
    _stop_unserved(tick)
    order = sorted(models.values(), key=lambda m: (m.keep == 0, -demand.get(m.name, 0), m.name))
    for model in order:
        _bring_up(tick, model, failures.get(model.name))
    _put_idle_away(tick)
    return tick.plan


def _stop_unserved(tick: _Tick) -> None:
    """Engines of models this fleet no longer serves (removed, disabled) stop, asleep or not."""
    for engine in tick.own(states=[*HOLDING, WorkerState.ASLEEP]):
        if engine.model not in tick.models and tick.state[engine.worker_id] is not WorkerState.DRAINING:
            tick.act(Action(Act.STOP, engine.model, "no longer served by this fleet (removed or disabled)",
                            engine.worker_id))


def _bring_up(tick: _Tick, model: FleetModel, failure: Failure | None) -> None:
    queued = tick.demand.get(model.name, 0)
    lines = tick.batch_demand.get(model.name, 0)
    short = model.keep - len(tick.own(model.name, SERVING))
    want = max(short, 1 if (queued or lines) and not tick.serving(model.name) else 0)
    for _ in range(want):
        if tick.own(model.name, [WorkerState.SLEEPING]):
            tick.plan.waiting[model.name] = "its engine is going to sleep; it is woken once asleep"
            return
        # Batch lines alone take an idle slot; they never put another engine away.
        if not _wake_or_start(tick, model, failure, evict=short > 0 or queued > 0):
            return


def _wake_or_start(tick: _Tick, model: FleetModel, failure: Failure | None, evict: bool = True) -> bool:
    """Wake or start one engine of ``model``, or (``evict``) make room for it; whether it got one now."""
    budget = tick.budget
    if model.keep and len(tick.own(model.name, SERVING)) < model.keep:
        why = "kept up (pinned)"
    elif tick.demand.get(model.name, 0):
        why = f"{tick.demand.get(model.name, 0)} request(s) queued"
    else:
        why = f"{tick.batch_demand.get(model.name, 0)} batch line(s) queued, on idle capacity"
    room = len(tick.holding()) < budget.max_awake
    free = tick.free_slots(model.gpu_share)
    for engine in sorted(tick.own(model.name, [WorkerState.ASLEEP]), key=lambda e: (e.sleep_level, -e.last_used_ms)):
        if room and not (budget.gpu and set(engine.slots) - set(free)):
            tick.act(Action(Act.WAKE, model.name, why, engine.worker_id))
            return True
    if failure is not None and tick.now_ms < failure.retry_at_ms():
        tick.plan.waiting[model.name] = _failed(failure, f"retrying in {(failure.retry_at_ms() - tick.now_ms) / 1000:.0f} s")
        return False
    needed = model.slots if budget.gpu else 0
    if room and len(free) >= needed:
        tick.act(Action(Act.START, model.name, why, slots=tuple(free[:needed])))
        return True
    if not evict:
        tick.plan.waiting[model.name] = "batch lines wait for an idle engine slot"
        return False
    _make_room(tick, model, needed)
    if failure is not None and failure.count >= FAILED_STARTS_SHOWN:
        tick.plan.waiting[model.name] = _failed(failure, tick.plan.waiting.get(model.name, ""))
    return False


def _failed(failure: Failure, then: str) -> str:
    return f"the start failed ({failure.count} time(s)): {failure.reason}" + (f"; {then}" if then else "")


def _make_room(tick: _Tick, model: FleetModel, needed: int) -> None:
    """Let go of as few idle engines as make room for one engine of ``model`` (``needed`` GPUs with room for
    its share), counting first on those already leaving; say in ``waiting`` what the model waits for."""
    budget = tick.budget
    holding = tick.holding()
    over = len(holding) + 1 - budget.max_awake
    chosen: list[Engine] = []

    def short() -> int:
        return needed - len(tick.free_slots(model.gpu_share, chosen)) if budget.gpu else 0

    for engine in [*tick.leaving(), *tick.evictable()]:
        if over <= 0 and short() <= 0:
            break
        before = short()
        chosen.append(engine)
        if over > 0:
            over -= 1
        elif short() >= before:  # on a GPU this engine frees no room the model can use
            chosen.pop()
    if over > 0 or short() > 0:
        serving = sorted({e.model for e in holding})
        what = f"no free engine slot: {len(holding)} of {budget.max_awake} busy serving {', '.join(serving)}"
        if budget.gpu and short() > 0:
            what = f"no free GPU: {model.name} needs {needed}, {len(tick.free_slots(model.gpu_share))} free " \
                   f"(busy serving {', '.join(serving)})"
        tick.plan.waiting[model.name] = what
        return
    verb = "sleep" if budget.gpu else "stop"
    for engine in chosen:
        tick.claimed.add(engine.worker_id)
        if tick.state[engine.worker_id] is WorkerState.WARM:
            tick.release(engine, f"least recently used idle engine: room for {model.name}")
    tick.plan.waiting[model.name] = f"waiting for {', '.join(e.model for e in chosen)} to {verb}"


def _put_idle_away(tick: _Tick) -> None:
    for engine in tick.own(states=[WorkerState.WARM]):
        model = tick.models.get(engine.model)
        if model is None or not tick.idle(engine) or tick.kept(engine) or tick.batch_demand.get(engine.model, 0):
            continue
        idle_s = (tick.now_ms - engine.last_used_ms) / 1000
        if idle_s >= model.idle_timeout_s:
            tick.release(engine, f"idle for {idle_s:.0f} s (timeout {model.idle_timeout_s:.0f} s)")
