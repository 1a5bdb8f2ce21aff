"""The soak's figures per window, and the verdicts: did anything grow, did the tail drift.

A resource is **flat** when its mean over the last window is within ``FLAT`` of its mean over the first
window after the warm-up, or within a small absolute slack for counts that are small integers (a file
descriptor or a connection more is not a leak). Latency has **drifted** when the last window's p99 is
more than ``DRIFT`` above the first's. The growth is measured on the processes that ran the whole soak
(chaos restarts the others, which would hide a leak behind each restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from bench.soak.load import SURVIVORS, Done

FLAT = 0.05
DRIFT = 0.10
# (what, how to read it from a sample, absolute slack)
RESOURCES: tuple[tuple[str, Any, float], ...] = (
    *((f"{role} RSS MiB", lambda s, r=role: s[r]["rss_mib"], 0.0) for role in SURVIVORS),
    *((f"{role} open fds", lambda s, r=role: s[r]["fds"], 2.0) for role in SURVIVORS),
    *((f"{role} threads", lambda s, r=role: s[r]["threads"], 1.0) for role in SURVIVORS),
    *((f"{role} asyncio tasks", lambda s, r=role: s[r].get("tasks"), 2.0) for role in SURVIVORS),
    ("Redis memory MiB", lambda s: s["redis_mib"], 0.0),
    ("Redis keys", lambda s: s["redis_keys"], 2.0),
    ("database connections", lambda s: s["db_connections"], 1.0),
    # Pending rows swing by a pass of the sender (100) and a restarted leader's lease (5 s here): ~10 s of it.
    ("billing outbox backlog", lambda s: s.get("outbox_pending"), 1000.0),
)


# Whose CPU each window shows, as a share of one core (not judged: it tells a load generator that cannot
# keep up from a platform that cannot).
CPU: tuple[tuple[str, Any], ...] = (
    ("load generator", lambda s: s.get("loadgen_cpu_s")),
    *((role, lambda s, r=role: s[r].get("cpu_s")) for role in SURVIVORS),
)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


@dataclass
class Window:
    index: int
    start_s: float
    end_s: float
    requests: int
    answered: int
    dropped: int
    p50_ms: float | None
    p99_ms: float | None
    means: dict[str, float | None]
    cpu_pct: dict[str, float | None] = field(default_factory=dict)


def windows(done: list[Done], samples: list[dict[str, Any]], window_s: float, end_s: float,
            dropped: Sequence[float] = ()) -> list[Window]:
    out = []
    count = max(int(end_s // window_s), 1)
    for i in range(count):
        lo, hi = i * window_s, (i + 1) * window_s
        took = [d.seconds * 1000 for d in done if lo <= d.at_s < hi and d.answered]
        inside = [s for s in samples if lo <= s["at_s"] < hi]
        means: dict[str, float | None] = {}
        for name, read, _slack in RESOURCES:
            values = [v for v in (read(s) for s in inside) if v is not None]
            means[name] = sum(values) / len(values) if values else None
        out.append(Window(i + 1, lo, hi, sum(1 for d in done if lo <= d.at_s < hi), len(took),
                          sum(1 for at in dropped if lo <= at < hi), pct(took, 0.5),
                          pct(took, 0.99), means, {name: cpu_pct(inside, read) for name, read in CPU}))
    return out


def cpu_pct(inside: list[dict[str, Any]], read: Any) -> float | None:
    """CPU seconds a second, in %, from the first to the last sample of a window that has both readings."""
    points = [(s["at_s"], v) for s in inside if (v := read(s)) is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0] or points[-1][1] < points[0][1]:
        return None  # too few readings, or a restarted process's counter
    return round(100 * (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]), 1)


@dataclass
class Verdict:
    what: str
    first: float | None
    last: float | None
    bound: str
    ok: bool | None  # None: not measured

    @property
    def change(self) -> str:
        if self.first is None or self.last is None:
            return "-"
        if not self.first:
            return f"{self.last - self.first:+g}"
        return f"{100 * (self.last - self.first) / self.first:+.1f} %"


def verdicts(rows: list[Window], warmup_windows: int) -> list[Verdict]:
    """Each resource, and the latency tail, from the first window after the warm-up to the last."""
    measured = rows[warmup_windows:] if len(rows) > warmup_windows + 1 else rows[-2:]
    first, last = measured[0], measured[-1]
    out = []
    for name, _read, slack in RESOURCES:
        a, b = first.means[name], last.means[name]
        if a is None or b is None:
            out.append(Verdict(name, a, b, "-", None))
            continue
        allowed = max(FLAT * abs(a), slack)
        bound = f"within {FLAT:.0%}" + (f" or {slack:g}" if slack else "")
        out.append(Verdict(name, round(a, 2), round(b, 2), bound, b - a <= allowed))
    a99, b99 = first.p99_ms, last.p99_ms
    out.append(Verdict("latency p99 ms", a99, b99, f"at most {DRIFT:.0%} above",
                       None if a99 is None or b99 is None else b99 <= a99 * (1 + DRIFT)))
    return out
