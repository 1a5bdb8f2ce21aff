"""Figures from what the rehearsal's clients saw: per plan, per lane in the busy and quiet minutes, goodput
and its timeline, and the verdict beside each of the issue's goals. Pure: records in, dicts out.

**Goodput** is the requests a second that met the service level objective (SLO): answered, the first
token within ``slo.ttft_s`` and a time per output token within ``slo.tpot_s``. A refusal is not good;
nor is an answer that came too late. It is what a platform delivers of what it was asked, the measure
on which a platform that queues and refuses by plan and one that lets everyone's latency grow compare.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.rehearsal.client import Record

PREMIUM_PLANS = ("premium", "enterprise")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def good(self, record: Record) -> bool:
        return record.answered and record.ttft_s is not None and record.ttft_s <= self.ttft_s \
            and (record.tpot_s is None or record.tpot_s <= self.tpot_s)


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank (q in 0..1); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def summary(records: Sequence[Record], slo: Slo, seconds: float | None = None) -> dict[str, Any]:
    """What a group of requests got."""
    answered = [r for r in records if r.answered]
    refused = [r for r in records if r.status == 429]
    ttft = [r.ttft_s for r in answered if r.ttft_s is not None]
    tpot = [r.tpot_s for r in answered if r.tpot_s is not None]
    gaps = [g for r in answered for g in r.gaps]
    good = sum(1 for r in records if slo.good(r))
    out: dict[str, Any] = {
        "sent": len(records), "answered": len(answered), "good": good,
        "slo_attainment": round(good / len(records), 4) if records else None,
        "lost": sum(1 for r in records if r.lost),
        "refused_429": len(refused),
        "codes": dict(Counter(r.code or str(r.status) for r in records if not r.answered)),
        "ttft_p50_ms": _ms(quantile(ttft, 0.5)), "ttft_p99_ms": _ms(quantile(ttft, 0.99)),
        "tpot_p50_ms": _ms(quantile(tpot, 0.5)), "tpot_p99_ms": _ms(quantile(tpot, 0.99)),
        "itl_p50_ms": _ms(quantile(gaps, 0.5)), "itl_p99_ms": _ms(quantile(gaps, 0.99)),
        "refusal_p50_ms": _ms(quantile([r.total_s for r in refused], 0.5)),
        "refusal_p99_ms": _ms(quantile([r.total_s for r in refused], 0.99)),
        "output_tokens": sum(r.completion_tokens for r in answered),
    }
    if seconds:
        out["goodput_rps"] = round(good / seconds, 3)
        out["output_tok_per_s"] = round(out["output_tokens"] / seconds, 1)
    return out


@dataclass(frozen=True, slots=True)
class Context:
    """What the analysis needs to know of each request beyond its record."""

    minute_of: dict[int, int]  # send index -> trace minute
    kind_of_minute: dict[int, str]  # trace minute -> busy / quiet / middle
    heavy: frozenset[int]  # account ranks
    seconds_per_minute: float  # replay seconds per trace minute

    def kind(self, record: Record) -> str:
        return self.kind_of_minute.get(self.minute_of[record.index], "middle")


def groups(records: Sequence[Record], ctx: Context, slo: Slo, duration_s: float) -> dict[str, Any]:
    """Every group the report shows, each a :func:`summary`."""
    main = [r for r in records if r.model == "main"]
    premium = [r for r in main if r.plan in PREMIUM_PLANS]
    standard = [r for r in main if r.plan not in PREMIUM_PLANS]
    quiet_accounts = [r for r in standard if r.rank not in ctx.heavy]
    busy_s = ctx.seconds_per_minute * sum(1 for k in ctx.kind_of_minute.values() if k == "busy")
    quiet_s = ctx.seconds_per_minute * sum(1 for k in ctx.kind_of_minute.values() if k == "quiet")

    def at(kind: str, rows: Iterable[Record]) -> list[Record]:
        return [r for r in rows if ctx.kind(r) == kind]

    out: dict[str, Any] = {"all": summary(main, slo, duration_s), "second_model": summary(
        [r for r in records if r.model == "second"], slo)}
    for plan in sorted({r.plan for r in main}):
        out[f"plan:{plan}"] = summary([r for r in main if r.plan == plan], slo)
    for name, rows in (("premium", premium), ("standard", standard), ("quiet_accounts", quiet_accounts),
                       ("heavy_accounts", [r for r in standard if r.rank in ctx.heavy])):
        out[name] = summary(rows, slo)
        out[f"{name}:busy"] = summary(at("busy", rows), slo, busy_s)
        out[f"{name}:quiet"] = summary(at("quiet", rows), slo, quiet_s)
    out["all:busy"] = summary(at("busy", main), slo, busy_s)
    out["all:quiet"] = summary(at("quiet", main), slo, quiet_s)
    waits = [r.model_wait_ms for r in records if r.model == "second" and r.model_wait_ms]
    out["second_model"]["model_waits"] = len(waits)
    out["second_model"]["model_wait_p50_ms"] = quantile(waits, 0.5)
    out["second_model"]["model_wait_max_ms"] = max(waits, default=None)
    return out


def timeline(records: Sequence[Record], ctx: Context, slo: Slo) -> list[dict[str, Any]]:
    """Per trace minute: requests sent, answered, good and refused a second, and premium's TTFT p50."""
    by_minute: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        if r.model == "main":
            by_minute[ctx.minute_of[r.index]].append(r)
    rows = []
    for minute in sorted(ctx.kind_of_minute):
        rs = by_minute.get(minute, [])
        premium_ttft = [r.ttft_s for r in rs if r.plan in PREMIUM_PLANS and r.answered and r.ttft_s is not None]
        standard_ttft = [r.ttft_s for r in rs if r.plan not in PREMIUM_PLANS and r.answered and r.ttft_s is not None]
        rows.append({"minute": minute, "kind": ctx.kind_of_minute[minute],
                     "offered_rps": round(len(rs) / ctx.seconds_per_minute, 2),
                     "answered_rps": round(sum(r.answered for r in rs) / ctx.seconds_per_minute, 2),
                     "good_rps": round(sum(slo.good(r) for r in rs) / ctx.seconds_per_minute, 2),
                     "refused_rps": round(sum(r.status == 429 for r in rs) / ctx.seconds_per_minute, 2),
                     "premium_ttft_p50_ms": _ms(quantile(premium_ttft, 0.5)),
                     "standard_ttft_p50_ms": _ms(quantile(standard_ttft, 0.5))})
    return rows


def flatness(samples: Sequence[dict[str, Any]], key: str, share: float = 0.2) -> dict[str, Any] | None:
    """A resource over the run: its mean in the first and the last ``share`` of the samples, and the change."""
    values = [s[key] for s in samples if s.get(key) is not None]
    if len(values) < 4:
        return None
    n = max(1, int(len(values) * share))
    first, last = sum(values[:n]) / n, sum(values[-n:]) / n
    return {"first": round(first, 1), "last": round(last, 1),
            "change": round(last / first - 1, 4) if first else None}


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    measured: str
    bound: str
    met: bool | None  # None: could not be measured


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def good_saved(record: dict[str, Any], slo: Slo) -> bool:
    """:meth:`Slo.good` of a saved record (a dict from the run's JSON)."""
    return (record["status"] == 200 and not record["code"] and not record["lost"] and record["ttft_s"] is not None
            and record["ttft_s"] <= slo.ttft_s and (record["tpot_s"] is None or record["tpot_s"] <= slo.tpot_s))


def admissible_goodput(records: Iterable[dict[str, Any]], admissible: set[int], slo: Slo, seconds: float) -> float:
    """Goodput over the requests the plans' rules let through (schedule.engine_load: each account's daily quota
    and prompt cap): what both platforms owe an answer. ``vllm serve`` has no plans and serves the rest too; a
    platform that sells plans refuses them, by design, and should not be compared on them."""
    return round(sum(1 for r in records if r["index"] in admissible and good_saved(r, slo)) / seconds, 3)


def verdicts(phases: dict[str, dict[str, Any]], vllm: dict[str, Any] | None, audit: dict[str, Any] | None,
             resources: dict[str, Any] | None, admissible: tuple[float, float] | None = None) -> list[Goal]:
    """The issue's goals, each with what was measured and whether it holds. ``admissible``: the goodput of
    Flatfare and of vllm serve over the requests the plans admit (:func:`admissible_goodput`)."""
    goals: list[Goal] = []
    full = phases.get("full", {}).get("groups")
    if full:
        busy, quiet = full["premium:busy"], full["premium:quiet"]
        for metric, bound in (("ttft_p50_ms", 1.2), ("ttft_p99_ms", 1.2), ("tpot_p50_ms", 1.5), ("tpot_p99_ms", 1.5)):
            r = _ratio(busy[metric], quiet[metric])
            goals.append(Goal(f"Premium {metric.split('_')[0].upper()} {metric.split('_')[1]}, busy / quiet minutes",
                              "-" if r is None else f"{r:.2f}x ({busy[metric]} / {quiet[metric]} ms)",
                              f"<= {bound}x", None if r is None else r <= bound))
        refused = full["premium"]["refused_429"]
        goals.append(Goal("Premium 429s", str(refused), "0", refused == 0))
    alone = phases.get("no-heavy", {}).get("groups")
    if full and alone:
        for metric in ("ttft_p50_ms", "ttft_p99_ms"):
            r = _ratio(full["quiet_accounts"][metric], alone["quiet_accounts"][metric])
            goals.append(Goal(f"Quiet accounts' {metric[:4].upper()} {metric[5:8]}, beside the heaviest / without them",
                              "-" if r is None else f"{r:.2f}x", "<= 1.5x", None if r is None else r <= 1.5))
    no_batch = phases.get("no-batch", {}).get("groups")
    if full and no_batch:
        r = _ratio(full["all"]["ttft_p99_ms"], no_batch["all"]["ttft_p99_ms"])
        goals.append(Goal("Live TTFT p99 with batch lines / without", "-" if r is None else f"{r:.2f}x",
                          "<= 1.10x", None if r is None else r <= 1.10))
        batch = phases["full"].get("batch", {})
        goals.append(Goal("Batch lines completed during the run", f"{batch.get('completed', 0)} of "
                          f"{batch.get('lines', 0)}", "> 0", batch.get("completed", 0) > 0))
    if full and vllm:
        ours, theirs = full["all"].get("goodput_rps"), vllm["groups"]["all"].get("goodput_rps")
        r = _ratio(ours, theirs) if theirs or not ours else float("inf")
        if admissible is not None:
            a = _ratio(*admissible) if admissible[1] or not admissible[0] else float("inf")
            goals.append(Goal("Goodput over the requests the plans admit, Flatfare / vllm serve (same trace)",
                              "-" if a is None else f"{a:.2f}x ({admissible[0]} / {admissible[1]} req/s)",
                              ">= 1.0x", None if a is None else a >= 1.0))
        goals.append(Goal("Goodput over every request sent, Flatfare / vllm serve (vllm serve answers what the "
                          "plans refuse)", "-" if r is None else f"{r:.2f}x ({ours} / {theirs} req/s)",
                          "(shown)", None))
    lost = sum(p["groups"]["all"]["lost"] + p["groups"]["second_model"]["lost"]
               for p in phases.values() if "groups" in p)
    goals.append(Goal("Requests lost (no answer, or a stream cut without an error)", str(lost), "0", lost == 0))
    if audit is not None:
        goals.append(Goal("Money audit: ledger = quota counters = outbox = meter events, nothing twice",
                          "; ".join(audit["faults"]) or "exact", "exact", not audit["faults"]))
    for name, flat in (resources or {}).items():
        if flat is not None and flat.get("change") is not None and "keys" not in name:  # keys: shown, see results
            goals.append(Goal(f"{name}, last minutes vs first", f"{flat['change'] * 100:+.1f} %", "flat (<= +10 %)",
                              flat["change"] <= 0.10))
    return goals


def batch_by_kind(progress: Sequence[dict[str, Any]], start_min: float, compression: float,
                  kinds: dict[int, str]) -> dict[str, int]:
    """Batch lines completed in the busy, quiet and middle minutes (and after the replay), from the batches'
    completed counts polled over the run (``t``: replay seconds)."""
    out: Counter[str] = Counter()
    done = 0
    for point in progress:
        minute = int(start_min + point["t"] * compression / 60)
        kind = kinds.get(minute, "after")
        out[kind] += point["completed"] - done
        done = point["completed"]
    return dict(out)
