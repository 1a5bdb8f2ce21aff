"""The pace governor: how many standard jobs and batch lines the engine may run at once, so that the
engine's pace stays near what it is without them.

Why. vLLM's priority scheduling orders the requests *waiting* inside the engine, but every request
already running shares each step: under others' overload the running batch grows to ``max_num_seqs``,
each step carries more decodes and more prefill chunks, and every stream slows, premium's too
(measured on an H100, 8B shape, by the engine alone: time per output token 7 -> 113 ms, premium TTFT
21x its idle figure). A flat-price platform must not let everyone's latency grow; it queues and
refuses by plan instead. So the worker, not the engine, decides how much non-premium work runs.

How. Each window the governor takes the mean of the engine's inter-token latencies (:meth:`record`,
from the engine's own stat logger; :meth:`token` times the streams' outputs for an engine without one):
the engine's *pace*. The *baseline* is the median pace of the last ``baseline_windows`` reference
windows: those in which the engine kept up with its demand (nothing waited in the pool's live lanes
nor in the engine's own queue, and no batch line ran), and those in which the standard lane was held
at its floor. The second kind matters: the pace also comes from what the governor does not decide
(premium work, another model sharing the GPU, the trace's own prompts), and a baseline learned only
in quieter conditions can sit below anything the limit can reach; at its floor the governor then
learns the pace it actually controls, instead of holding the lane there for good while everyone
waits (the first GPU rehearsal did exactly that: a baseline from a premium-only warm-up, the limit at
its floor for the whole run, half the standard requests refused).

While work waits, the governor holds the pace within ``slack`` x the baseline. Past the target it
cuts, at most once per ``cooldown_s`` (a lower limit only stops new starts; the pace falls as running
jobs end), by as much as the pace is over (never by more than half): batch lines first, while any run
(their allowance, :attr:`batch_limit`, goes down to what they hold times the cut, to zero if need be),
and the standard limit too, down to ``floor`` at least (so the standard lane always moves), where no
lines run or, while live work waits, where the lines running are fewer than what the cut takes off:
the third GPU rehearsal opened each phase with 16 lines running and a burst of standard jobs; every cut
went to the lines' allowance, already at zero, while the standard lane doubled each window to 128 jobs
and the pace went to 20-60 ms against a target of 8 ms for 25 s, until the last line ended. A batch line
thus never costs a live request its slot: in the first GPU rehearsal one limit for both let lines that
slowed the pace cut the standard lane, and live requests waited up to 0.6 s in it (TTFT p99 1.8x the
run without lines). Under 0.9 x the target the standard limit grows by a sixteenth a window where it
binds, and the batch allowance where no live work waits. The standard limit also never exceeds twice
what ran at the last window's end: a burst is measured before it floods the engine. Premium jobs are
never governed: they use the slots left, the worker's premium reserve and the engine's priority. What
the standard lane can no longer take waits at the gateway, whose lane bound follows the drain rate,
and is refused with a Retry-After once it would wait too long.

Plain arithmetic on floats, no IO: the worker loop feeds it and reads :attr:`limit`, :attr:`batch_limit`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# A window needs this many latencies to say anything about the pace.
MIN_SAMPLES = 8
# Outputs closer than this are one step's (a stream's role chunk and its first token, its last token and its
# usage): no engine step is this short, so such a gap says nothing about the pace.
MIN_GAP_S = 0.001
# Under this fraction of the target, a binding limit grows.
RAISE_BELOW = 0.9
DECREASE = 0.85
MAX_CUT = 0.5


@dataclass
class PaceGovernor:
    """The limits on standard jobs and batch lines running at once (see the module's docstring)."""

    ceiling: int  # the most either limit may be: the slots standard may fill at all
    slack: float = 1.3
    floor: int = 4
    window_s: float = 1.0
    baseline_windows: int = 60
    cooldown_s: float = 2.0
    # The standard limit the pace allows (additive increase, multiplicative decrease); :attr:`limit` also caps
    # its growth. Batch lines have an allowance of their own, cut first.
    allowed: int = field(init=False)
    batch_allowed: int = field(init=False)
    baseline_s: float | None = field(default=None, init=False)
    pace_s: float | None = field(default=None, init=False)
    _standard: int = field(default=0, init=False)
    _last_token: dict[str, float] = field(default_factory=dict, init=False)
    _gaps: list[float] = field(default_factory=list, init=False)
    _reference: deque[float] = field(init=False)
    _last_cut: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.ceiling))
        self.allowed = self.ceiling
        self.batch_allowed = self.floor
        self._reference = deque(maxlen=self.baseline_windows)

    @property
    def limit(self) -> int:
        """Standard jobs that may run now: what the pace allows, and at most twice what ran at the last
        window's end (a burst doubles each window, so the pace is measured before the engine is flooded)."""
        return min(self.allowed, max(self.floor, 2 * self._standard))

    @property
    def batch_limit(self) -> int:
        """Batch lines that may run now, beside the standard jobs (never in their place)."""
        return self.batch_allowed

    @property
    def target_s(self) -> float | None:
        return None if self.baseline_s is None else self.baseline_s * self.slack

    def token(self, job: str, now: float) -> None:
        """An output of ``job``'s stream arrived at ``now`` (monotonic seconds)."""
        last = self._last_token.get(job)
        if last is None:
            self._last_token[job] = now
        elif now - last >= MIN_GAP_S:
            self._gaps.append(now - last)
            self._last_token[job] = now

    def end(self, job: str) -> None:
        self._last_token.pop(job, None)

    def record(self, gaps: Iterable[float]) -> None:
        """Inter-token latencies the engine reported itself (flatfare.workers.engine.EnginePace)."""
        self._gaps.extend(gaps)

    def tick(self, now: float, standard: int, backlog: bool, batch: int = 0) -> int:
        """Close the window: ``standard`` jobs and ``batch`` lines run now; ``backlog``: work waits, in the pool's
        live lanes or in the engine's own queue. Returns the new :attr:`limit`."""
        self._standard = standard
        gaps, self._gaps = self._gaps, []
        if len(gaps) < MIN_SAMPLES:
            return self.limit
        self.pace_s = statistics.fmean(gaps)
        if (not backlog and not batch) or (backlog and standard <= self.floor and self.allowed <= self.floor):
            self._reference.append(self.pace_s)
            self.baseline_s = statistics.median(self._reference)
        target = self.target_s
        if target is None:  # no baseline yet: nothing to hold the pace to
            return self.limit
        if self.pace_s > target and (backlog or batch):
            if now - self._last_cut >= self.cooldown_s:
                cut = max(MAX_CUT, min(DECREASE, target / self.pace_s))
                # What must stop running for the pace to come back: the lines first (the work nobody waits
                # on); the standard lane too, under a backlog, when the lines running are fewer than that.
                excess = standard + batch - int((standard + batch) * cut)
                if batch:
                    self.batch_allowed = int(min(self.batch_allowed, batch) * cut)
                if not batch or (backlog and batch < excess):
                    self.allowed = max(self.floor, int(min(self.allowed, standard) * cut))
                self._last_cut = now
        elif self.pace_s < target * RAISE_BELOW:
            if standard >= self.allowed:  # the limit binds: room to grow (doubling in about 11 s)
                self.allowed = min(self.ceiling, self.allowed + max(1, self.allowed // 16))
            if not backlog and batch >= self.batch_allowed:
                self.batch_allowed = min(self.ceiling, self.batch_allowed + max(1, self.batch_allowed // 16))
        return self.limit

    def state(self) -> dict[str, float | int | None]:
        """What a heartbeat shows: the limits, the pace, its baseline and target (ms)."""
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 2)

        return {"limit": self.limit, "allowed": self.allowed, "batch_limit": self.batch_limit,
                "ceiling": self.ceiling, "pace_ms": ms(self.pace_s), "baseline_ms": ms(self.baseline_s),
                "target_ms": ms(self.target_s)}
