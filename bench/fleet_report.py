"""bench.fleet's results as Markdown tables and a timeline plot (awake engines per model, request TTFTs)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench import report

# Engine states on the timeline, and their colours.
COLOURS = {"starting": "tab:orange", "warm": "tab:green", "waking": "gold", "sleeping": "tab:gray",
           "draining": "tab:gray", "asleep": "lightsteelblue"}
KIND_MARKERS = {"start": ("o", "tab:red"), "wake L1": ("s", "tab:blue"), "wake L2": ("D", "tab:purple"),
                "warm": ("^", "tab:green"), "plain start": ("*", "black")}
KIND_LABELS = {"plain start": "by hand: start to warm + TTFT"}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _fmt(value: Any, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}" if isinstance(value, float | int) else str(value)


def by_kind(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for record in data["requests"]:
        kinds.setdefault(record["kind"], []).append(record)
    return kinds


def checks_lines(data: dict[str, Any]) -> list[str]:
    c = data.get("checks") or {}
    if not c:
        return ["Checks: not reached (the run stopped before its end)."]
    return [f"- Requests: {c['requests']}, lost: **{c['lost']}** (lost: not answered 200, or its ledger row is not "
            "`succeeded 200`).",
            f"- Budget: max_awake {c['max_awake']}; the most engines awake in any of {c['samples']} samples (every "
            f"0.25 s): **{c['max_awake_seen_status']}** by the fleet's status, **{c['max_awake_seen_heartbeats']}** "
            "by the workers' heartbeats (awake: any state but asleep)."]


def fleet_steps(data: dict[str, Any], record: dict[str, Any]) -> str:
    """The fleet's decisions while the request waited for its first token, ms after it was sent."""
    sent = record.get("sent_ms")
    if not sent or "ttft_s" not in record:
        return "-"
    until = sent + record["ttft_s"] * 1000
    steps = [f"{d['action']} {d['model']} +{d['t'] - sent} ms"
             for d in data["meta"].get("fleet", {}).get("decisions", []) if sent <= d["t"] <= until]
    return "; ".join(steps) or "-"


def request_table(data: dict[str, Any]) -> list[str]:
    lines = ["| # | at (s) | model | met | status | ledger | TTFT (s) | model wait (ms) | the fleet meanwhile | "
             "GPU MiB after |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in enumerate(sorted(data["requests"] + data.get("plain", []), key=lambda r: r["t"]), 1):
        kind = r["kind"] + (f" (warm after {r['warm_s']} s)" if "warm_s" in r else "")
        lines.append(f"| {n} | {r['t']} | {r['model']} | {kind} | {r.get('status')} | {r.get('ledger', '-')} | "
                     f"{_fmt(r.get('ttft_s'))} | {_fmt(r.get('model_wait_ms'))} | {fleet_steps(data, r)} | "
                     f"{_fmt(r.get('gpu_memory_used_mib'))} |")
    return lines


def kind_table(data: dict[str, Any]) -> list[str]:
    lines = ["| request met | n | TTFT median (s) | min | max | worker's own start/wake (s, last) |",
             "| --- | --- | --- | --- | --- | --- |"]
    facts = data["meta"].get("facts", {})
    for kind, records in by_kind(data).items():
        ttfts = [r["ttft_s"] for r in records if "ttft_s" in r]
        fact = ""
        if kind == "start":
            fact = ", ".join(f"{m} {f['start_s']:g}" for m, f in facts.items() if f.get("start_s"))
        elif kind.startswith("wake"):
            fact = ", ".join(f"{m} {f['wake_s']:g}" for m, f in facts.items() if f.get("wake_s"))
        lines.append(f"| {kind} | {len(records)} | {_fmt(_median(ttfts))} | {_fmt(min(ttfts, default=None))} | "
                     f"{_fmt(max(ttfts, default=None))} | {fact or '-'} |")
    return lines


def cpu_markdown(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    lines = [f"# Three models, one CPU engine: `python -m bench fleet cpu` ({meta['started']})", "",
             f"Flatfare's whole path (private Redis, SQLite, gateway, `flatfare fleet --max-awake 1 --on-demand`) on "
             f"this 2-core machine, vLLM's CPU engine, engine options {json.dumps(meta['engine_options'])} over each "
             f"entry's. Models: {', '.join(meta['models'])} (the last a second catalog entry on smollm2's folder). "
             "Requests through the `openai` SDK, streamed, one at a time, rotating A,A,B,B,C,C,...: the first of each "
             "pair meets no engine (the budget stopped the previous model's) and waits for a start, the second is "
             "warm. "
             "Beside it, in the same run, `flatfare worker --model M` started by hand with no fleet running "
             "(smollm2 before the fleet's turns, gemma after): its seconds to warm and its first request's TTFT.", "",
             "| model | through the fleet: cold TTFT, median (s) | its model wait (ms) | by hand: start to warm + "
             "first TTFT (s) | warm TTFT, median (s) |", "| --- | --- | --- | --- | --- |"]
    plain = {p["model"]: p for p in data.get("plain", [])}
    for model in meta["models"]:
        cold = [r for r in data["requests"] if r["model"] == model and r["kind"] == "start"]
        warm = [r["ttft_s"] for r in data["requests"] if r["model"] == model and r["kind"] == "warm" and "ttft_s" in r]
        p = plain.get(model)
        by_hand = f"{p['warm_s']} + {p.get('ttft_s')} = {p['warm_s'] + (p.get('ttft_s') or 0):.2f}" if p else "-"
        lines.append(f"| {model} | {_fmt(_median([r['ttft_s'] for r in cold if 'ttft_s' in r]))} (n={len(cold)}) | "
                     f"{_fmt(_median([r['model_wait_ms'] for r in cold if r.get('model_wait_ms') is not None]))} | "
                     f"{by_hand} | {_fmt(_median(warm))} |")
    return lines + ["", *checks_lines(data), "", "Every request:", "", *request_table(data)]


def gpu_markdown(data: dict[str, Any]) -> list[str]:
    meta = data["meta"]
    title = {"levels": "full start vs level-1 and level-2 wakes", "many": f"{len(meta['models'])} models on one GPU"}
    tick = meta.get("fleet", {}).get("tick_s")
    lines = [f"## {title[meta['part']]}{f', a decision every {tick:g} s' if tick else ''} ({meta['started']})", "",
             f"Folder {meta['model_dir']}, engine options {json.dumps(meta['engine_options'])}, "
             f"`flatfare fleet --max-awake 1`; models {', '.join(meta['models'])}."]
    if meta["part"] == "levels":
        lines.append(f"Host memory for level-1 sleepers: 1.5 x the weights ({meta.get('weights_gb')} GiB): one "
                     "sleeper keeps its weights in RAM (level 1), the other drops them (level 2, reloaded from disk).")
    if meta.get("stopped_early"):
        lines.append(f"Stopped early: {meta['stopped_early']}.")
    lines += ["", *kind_table(data), ""]
    kinds = {k: [r["ttft_s"] for r in v if "ttft_s" in r] for k, v in by_kind(data).items()}
    start = _median(kinds.get("start", []))
    for kind in ("wake L1", "wake L2", "warm"):
        if start and _median(kinds.get(kind, [])):
            lines.append(f"- {kind}: first token {start / _median(kinds[kind]):.0f}x sooner than after a full start.")
    if meta["part"] == "many" and kinds.get("wake L1"):
        woken = {r["model"] for r in data["requests"] if r["kind"] == "wake L1" and r.get("ttft_s", 99) <= 1.5}
        lines.append(f"- Goal (an asleep model answers within 1.5 s, >= 40x sooner than its full start, at least 6 "
                     f"models): {len(woken)} of {len(meta['models'])} models woke within 1.5 s.")
    return lines + ["", *checks_lines(data), "", "Every request:", "", *request_table(data)]


def plot(data: dict[str, Any], path: Path) -> bool:
    """Engines' states per model over time, awake engines against the budget, and each request's TTFT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[fleet] matplotlib is not installed (the bench extra): no plot")
        return False
    models = data["meta"]["models"]
    samples = data["samples"]
    fig, (lanes, awake, ttft) = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True,
                                             gridspec_kw={"height_ratios": [len(models) * 0.6 + 0.8, 1, 1.6]})
    for row, model in enumerate(models):
        spans: list[tuple[float, float, str]] = []
        for i, s in enumerate(samples):
            states = [v for k, v in s["heartbeats"].items() if k.split("|")[0] == model]
            state = states[0].split()[0] if states else ""
            end = samples[i + 1]["t"] if i + 1 < len(samples) else s["t"] + 0.25
            if state and spans and spans[-1][2] == state and abs(spans[-1][1] - s["t"]) < 1e-6:
                spans[-1] = (spans[-1][0], end, state)
            elif state:
                spans.append((s["t"], end, state))
        for begin, end, state in spans:
            lanes.broken_barh([(begin, end - begin)], (row - 0.35, 0.7), color=COLOURS.get(state, "black"))
    lanes.set_yticks(range(len(models)), models)
    lanes.invert_yaxis()
    lanes.set_title("each model's engine (workers' heartbeats, every 0.25 s)")
    lanes.legend(handles=[matplotlib.patches.Patch(color=c, label="sleeping/draining" if s == "sleeping" else s)
                          for s, c in COLOURS.items() if s != "draining"], loc="upper right", fontsize=7, ncol=5)
    awake.step([s["t"] for s in samples], [s["awake_heartbeats"] for s in samples], where="post", label="awake")
    awake.axhline(data["meta"]["max_awake"], color="tab:red", linestyle="--", label="max_awake")
    awake.set_ylim(-0.1, max(2, data["meta"]["max_awake"] + 1))
    awake.set_ylabel("engines awake")
    awake.legend(loc="upper right", fontsize=7)
    for kind, (marker, colour) in KIND_MARKERS.items():
        # A start by hand: its seconds to warm plus its first TTFT, what a client asking at its start waits.
        points = [(r["t"], r["ttft_s"] + r.get("warm_s", 0)) for r in data["requests"] + data.get("plain", [])
                  if r["kind"] == kind and "ttft_s" in r]
        if points:
            ttft.scatter(*zip(*points, strict=True), marker=marker, color=colour,
                         label=KIND_LABELS.get(kind, kind))
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT (s, client)")
    ttft.set_xlabel("seconds since the run started (a request's point: when it was sent)")
    ttft.legend(loc="center right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(out: Path, data: dict[str, Any]) -> None:
    """``out``.md (and .png) beside ``out``.json."""
    lines = cpu_markdown(data) if data["meta"]["mode"] == "cpu" else [f"# `python -m bench fleet gpu`", "",
                                                                      *gpu_markdown(data)]
    if plot(data, out.with_suffix(".png")):
        lines += ["", f"![timeline]({out.with_suffix('.png').name})"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"[fleet] wrote {out.with_suffix('.md')}")


def write_gpu_report(paths: list[Path], out: Path) -> None:
    """The gpu runs' JSON files (or folders holding them) as one Markdown file, one plot per part."""
    files = [f for p in paths for f in (sorted(p.rglob("*.json")) if p.is_dir() else [p])]
    runs = [d for d in (json.loads(f.read_text()) for f in files)
            if isinstance(d, dict) and d.get("meta", {}).get("mode") == "gpu"]
    if not runs:
        raise SystemExit(f"no bench.fleet gpu JSON among {', '.join(map(str, files)) or 'nothing'}")
    cards = sorted({d["meta"]["card"] for d in runs if d["meta"].get("card")}) or [report.card_of(paths)]
    card = " / ".join(cards)
    lines = [f"# Many models on one {card}: `python -m bench fleet gpu`", "",
             f"Flatfare's whole path on the lent {card} (private Redis, SQLite, gateway, "
             "`flatfare fleet --max-awake 1`, "
             "workers started with vLLM's sleep mode), requests through the `openai` SDK, streamed, one at a time, "
             "each "
             "from a settled fleet; TTFT measured by the client. 'met' is what the request's model's engine was doing "
             "when it was sent: none (start), asleep (wake L1/L2), warm."]
    out.parent.mkdir(parents=True, exist_ok=True)
    seen: dict[str, int] = {}
    for data in runs:
        part = data["meta"]["part"]
        seen[part] = seen.get(part, 0) + 1
        lines += ["", *gpu_markdown(data)]
        png = out.with_name(f"{out.name}_{part}{'' if seen[part] == 1 else f'-{seen[part]}'}.png")
        if plot(data, png):
            lines += ["", f"![{part}]({png.name})"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"[fleet] wrote {out.with_suffix('.md')}")
