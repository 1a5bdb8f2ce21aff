"""Tables and plots of ``python -m bench scheduling``: each goal of issue 19 beside what was measured,
whether it was met and by how much it was missed; every group's figures; every request, raw."""

from __future__ import annotations

import argparse
import csv
import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import report
from bench.traffic import CUT_OFF, Group, GroupSummary, percentile

if TYPE_CHECKING:
    from bench.scheduling import Run

PREMIUM_TTFT_GOAL = 1.2  # premium TTFT under others' overload, times the same clients' on an idle platform
NEIGHBOUR_P99_GOAL = 1.5  # the neighbours' TTFT p99 beside a flood, times theirs without it
REFUSAL_P99_GOAL_MS = 5.0
QUEUED_GOAL_S = 60.0  # "not queued for minutes"

GROUP_COLUMNS = ["run", "group", "accounts", "load", "sent", "answered", "429", "429 codes", "cut off", "other",
                 "TTFT p50 ms", "TTFT p99 ms", "queued p50 ms", "queued p99 ms", "refusal p50 ms", "refusal p99 ms",
                 "client lag p99 ms"]


def _ratio(after: float | None, before: float | None) -> float | None:
    return report.ratio(after, before)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _at_most(value: float | None, goal: float, unit: str = "x") -> str:
    """'yes', or 'no: by how much' (the shortfall, relative to the goal)."""
    if value is None:
        return "not measured"
    if value <= goal:
        return "yes"
    return f"no: {value:.2f}{unit}, {(value / goal - 1) * 100:.0f} % over the goal"


def _zero(count: int) -> str:
    return "yes" if count == 0 else f"no: {count}"


def _load(group: Group, capacity_rps: float) -> str:
    if group.rate:
        return f"{group.rate:.2f} req/s ({group.rate / capacity_rps * 100:.0f} % of capacity), open loop"
    return f"{group.clients} clients, closed loop"


def _codes(summary: GroupSummary) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(summary.codes.items())) or "-"


def group_rows(runs: Sequence[Run], capacity_rps: float) -> list[list[Any]]:
    rows = []
    for run in runs:
        lag = percentile(run.result.loop_lag_s, 99)
        for group in run.groups:
            s = run.summary(group.name)
            rows.append([run.name, group.name, len(group.keys), _load(group, capacity_rps), s.sent, s.answered,
                         s.refused, _codes(s), s.cut_off, s.other_errors, s.ttft_p50_ms, s.ttft_p99_ms,
                         s.queue_p50_ms, s.queue_p99_ms, s.refusal_p50_ms, s.refusal_p99_ms,
                         None if lag is None else lag * 1000])
    return rows


def _floor(capacity: dict[str, Any], alone_p50_ms: float | None) -> list[Any]:
    """The engine's own TTFT with every slot busy and nothing queued (the capacity run): no scheduling
    in front of the engine brings a request that joins a full batch below it."""
    return ["TTFT p50 with every slot busy, nothing queued (the capacity run: the engine's floor)", "",
            capacity["ttft_p50_ms"], _times(_ratio(capacity["ttft_p50_ms"], alone_p50_ms)), "", ""]


def _premium_goals(alone: Run, loaded: Run, overload: float, capacity: dict[str, Any]) -> list[list[Any]]:
    idle, busy = alone.summary("premium"), loaded.summary("premium")
    standard = loaded.summary("standard")
    rows: list[list[Any]] = []
    for q, idle_ms, busy_ms in (("p50", idle.ttft_p50_ms, busy.ttft_p50_ms),
                                ("p99", idle.ttft_p99_ms, busy.ttft_p99_ms)):
        ratio = _ratio(busy_ms, idle_ms)
        rows.append([f"premium TTFT {q} (ms)", idle_ms, busy_ms, _times(ratio), f"<= {PREMIUM_TTFT_GOAL}x idle",
                     _at_most(ratio, PREMIUM_TTFT_GOAL)])
    rows.append(_floor(capacity, idle.ttft_p50_ms))
    rows.append(["premium 429s", idle.refused, busy.refused, "", "0", _zero(idle.refused + busy.refused)])
    rows.append(["premium requests answered", f"{idle.answered} of {idle.sent}", f"{busy.answered} of {busy.sent}",
                 "", "all", "yes" if (idle.answered, busy.answered) == (idle.sent, busy.sent) else "no"])
    share = f" ({standard.refused / standard.sent * 100:.0f} %)" if standard.sent else ""
    rows.append([f"standard requests refused (429), at {overload:g}x capacity", "", f"{standard.refused} of "
                 f"{standard.sent}{share}", "", "the excess", "yes" if standard.refused else "no: none refused"])
    rows.append(["standard 429s with Retry-After", "", f"{standard.refusals_with_retry_after} of {standard.refused}",
                 "", "all", "yes" if standard.refusals_with_retry_after == standard.refused else
                 f"no: {standard.refused - standard.refusals_with_retry_after} without"])
    rows.append(["standard time to the refusal p50 (ms)", "", standard.refusal_p50_ms, "", "", ""])
    rows.append(["standard time to the refusal p99 (ms)", "", standard.refusal_p99_ms, "",
                 f"< {REFUSAL_P99_GOAL_MS:g} ms", _at_most(standard.refusal_p99_ms, REFUSAL_P99_GOAL_MS, " ms")])
    # Admitted standard requests still open when the run ended count with their time so far.
    mine = loaded.result.of("standard")
    waits = [o.ttft_s for o in mine if o.status == 200 and o.ttft_s is not None]
    still = [o.total_s for o in mine if o.status == CUT_OFF]
    longest = max(waits + still) if waits or still else None
    rows.append([f"standard admitted: longest wait for a first token (s; {len(still)} still open at the end, their "
                 "time so far)", "", longest, "", f"not minutes (< {QUEUED_GOAL_S:g} s)",
                 _at_most(longest, QUEUED_GOAL_S, " s")])
    return rows


def _noisy_goals(alone: Run, flooded: Run, capacity: dict[str, Any]) -> list[list[Any]]:
    quiet, busy = alone.summary("neighbours"), flooded.summary("neighbours")
    flood = flooded.summary("flooder")
    p50, p99 = _ratio(busy.ttft_p50_ms, quiet.ttft_p50_ms), _ratio(busy.ttft_p99_ms, quiet.ttft_p99_ms)
    return [
        ["the nine's TTFT p50 (ms)", quiet.ttft_p50_ms, busy.ttft_p50_ms, _times(p50), "", ""],
        ["the nine's TTFT p99 (ms)", quiet.ttft_p99_ms, busy.ttft_p99_ms, _times(p99),
         f"<= {NEIGHBOUR_P99_GOAL}x without", _at_most(p99, NEIGHBOUR_P99_GOAL)],
        _floor(capacity, quiet.ttft_p50_ms),
        ["the nine's 429s", quiet.refused, busy.refused, "", "0", _zero(quiet.refused + busy.refused)],
        ["the nine's requests answered", f"{quiet.answered} of {quiet.sent}", f"{busy.answered} of {busy.sent}",
         "", "all", "yes" if (quiet.answered, busy.answered) == (quiet.sent, busy.sent) else "no"],
        ["the flooder's 429s", "", f"{flood.refused} of {flood.sent}", "", "the flooder's, not the nine's",
         "yes" if flood.refused and not busy.refused else "no"],
        ["the flooder's answered requests", "", flood.answered, "", "", ""],
        ["the flooder's time to the refusal p99 (ms)", "", flood.refusal_p99_ms, "", "", ""],
    ]


GOAL_COLUMNS = ["measure", "alone", "beside the load", "ratio", "goal", "met"]


def scenario_sections(args: argparse.Namespace, capacity: dict[str, Any], runs: Sequence[Run],
                      out: Path) -> list[tuple[str, str]]:
    rps = capacity["req_per_s"]
    sections = [("Capacity and plans", _capacity_text(capacity))]
    _write_raw(out / "raw" / "scheduling_outcomes.csv.gz", runs)
    for scenario, title in (("premium", "Premium under overload caused by others"),
                            ("noisy", "Noisy neighbour: one account floods, nine send at a normal rate")):
        mine = [r for r in runs if r.scenario == scenario]
        if len(mine) != 2:
            continue
        goals = (_premium_goals(mine[0], mine[1], args.overload, capacity) if scenario == "premium"
                 else _noisy_goals(mine[0], mine[1], capacity))
        rows = group_rows(mine, rps)
        report.write_csv(out / f"scheduling_{scenario}.csv", GROUP_COLUMNS, rows)
        plot_scenario(out / f"scheduling_{scenario}.png", scenario, mine)
        sections.append((title, "\n\n".join([
            report.markdown_table(GOAL_COLUMNS, goals),
            "Every group of both runs (TTFT of answered requests; queued: the gateway's `x-flatfare-queue-ms`, its"
            " receipt to a worker starting the job, the rest of the TTFT is the engine's; refusal: time to a whole"
            " 429 answer; client lag: how late the load generator's own 10 ms timer woke, part of every time it"
            " measured):",
            report.markdown_table(GROUP_COLUMNS, rows),
            f"![{scenario}](scheduling_{scenario}.png)"])))
    refusals = [r for r in runs if r.scenario in ("premium", "noisy")]
    if refusals:
        plot_refusals(out / "scheduling_refusals.png", refusals)
        sections.append(("Time to a refusal", "![refusals](scheduling_refusals.png)"))
    return sections


def _capacity_text(capacity: dict[str, Any]) -> str:
    text = (f"The worker holds {capacity['slots']} jobs; at {capacity['slots']} closed-loop clients it completed "
            f"**{capacity['req_per_s']:.2f} requests/s** (TTFT p50 {capacity['ttft_p50_ms']:,.0f} ms, p99 "
            f"{capacity['ttft_p99_ms']:,.0f} ms). Every rate below is a fraction of that.")
    plans = capacity.get("plans") or {}
    if plans:
        rows = [[name, p.get("lane"), p.get("daily_limit"), p.get("max_inflight", "(not in this version)")]
                for name, p in sorted(plans.items())]
        text += "\n\nPlans in force (admin API):\n\n" + report.markdown_table(
            ["plan", "lane", "requests a day", "max in flight"], rows)
    return text


def _write_raw(path: Path, runs: Sequence[Run]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["scenario", "run", "group", "account", "sent_s", "status", "code", "ttft_ms", "total_ms",
                         "retry_after", "queued_ms"])
        for run in runs:
            for o in run.result.outcomes:
                writer.writerow([run.scenario, run.name, o.group, o.account, f"{o.sent_s:.4f}", o.status, o.code,
                                 "" if o.ttft_s is None else f"{o.ttft_s * 1000:.2f}", f"{o.total_s * 1000:.2f}",
                                 o.retry_after or "", "" if o.queue_ms is None else o.queue_ms])


# -- plots -----------------------------------------------------------------------------------------

def _pyplot():  # noqa: ANN202 - matplotlib.pyplot, imported late (no work at import time)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scenario(path: Path, scenario: str, runs: Sequence[Run]) -> None:
    """Left: the measured group's TTFT p50/p99 alone and beside the load, the goal drawn; right: every
    request of the loaded run over time (refusals at their refusal time)."""
    plt = _pyplot()
    measured = "premium" if scenario == "premium" else "neighbours"
    other = "standard" if scenario == "premium" else "flooder"
    goal = PREMIUM_TTFT_GOAL if scenario == "premium" else NEIGHBOUR_P99_GOAL
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 4.4), dpi=100)
    summaries = [r.summary(measured) for r in runs]
    for i, (q, attr) in enumerate((("p50", "ttft_p50_ms"), ("p99", "ttft_p99_ms"))):
        values = [getattr(s, attr) or 0 for s in summaries]
        left.bar([j + (i - 0.5) * 0.38 for j in range(len(runs))], values, width=0.38, label=f"TTFT {q}")
        if scenario == "premium" or q == "p99":
            left.hlines(values[0] * goal, 1 - 0.45, 1 + 0.45, colors="black", linestyles="dashed",
                        label=(f"goal: {goal}x alone" if scenario == "premium" else f"goal: p99 within {goal}x alone")
                        if i == 0 or scenario == "noisy" else None)
    left.set_xticks(range(len(runs)), [r.name for r in runs], fontsize=8)
    left.set_ylabel("time to first token (ms)")
    left.set_title(f"{measured}: alone vs beside the {other}")
    left.legend(fontsize=8)
    loaded = runs[-1]
    for group, color in ((other, "tab:gray"), (measured, "tab:blue")):
        mine = [o for o in loaded.result.outcomes if o.group == group and o.status != CUT_OFF]
        ok = [o for o in mine if o.status == 200 and o.ttft_s is not None]
        right.scatter([o.sent_s for o in ok], [o.ttft_s * 1000 for o in ok if o.ttft_s is not None], s=8,
                      color=color, label=f"{group}: TTFT", alpha=0.7)
        no = [o for o in mine if o.refused]
        if no:
            right.scatter([o.sent_s for o in no], [o.total_s * 1000 for o in no], s=8, marker="x",
                          color="tab:red" if group == other else "tab:orange", label=f"{group}: 429, time to it",
                          alpha=0.5)
    right.axvspan(0, loaded.result.duration_s, color="tab:green", alpha=0.06, label="measured window")
    right.set_yscale("log")
    right.set_xlabel("sent at (s, 0 = the measured window's start)")
    right.set_ylabel("ms (log)")
    right.set_title(f"{loaded.name}: every request")
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_refusals(path: Path, runs: Sequence[Run]) -> None:
    """The distribution of the time to a 429, per refused group, against the 5 ms goal."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for run in runs:
        for group in run.groups:
            times = sorted(o.total_s * 1000 for o in run.result.of(group.name) if o.refused)
            if times:
                ax.plot(times, [(i + 1) / len(times) for i in range(len(times))],
                        label=f"{group.name} ({run.name}), {len(times)} refusals")
    ax.axvline(REFUSAL_P99_GOAL_MS, color="black", linestyle="dashed", label=f"goal: p99 < {REFUSAL_P99_GOAL_MS:g} ms")
    ax.axhline(0.99, color="gray", linestyle="dotted")
    ax.set_xscale("log")
    ax.set_xlabel("time to the whole 429 answer (ms, log)")
    ax.set_ylabel("fraction of refusals")
    ax.set_title("How fast the excess is refused")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_routing(path: Path, rows: list[list[Any]]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for mode, color in (("prefix routing", "tab:green"), ("plain sharing", "tab:gray")):
        mine = [r for r in rows if r[0] == mode]
        ax.scatter([r[1] for r in mine], [r[4] or 0 for r in mine], label=f"{mode} p50", color=color, marker="o")
        ax.scatter([r[1] for r in mine], [r[5] or 0 for r in mine], label=f"{mode} p99", color=color, marker="^")
    ax.set_xlabel("run")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Shared system prompts on 2 CPU workers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
