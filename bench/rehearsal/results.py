"""bench/results/rehearsal_{gpu,cpu}.md, .csv and plots from the rehearsal's JSON (Flatfare's, and ``vllm
serve``'s where it ran): the verdict beside each goal first, then the figures behind them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from bench import report
from bench.rehearsal import analysis, schedule

GROUP_COLUMNS = ["sent", "answered", "429", "other errors", "lost", "SLO met %", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "time to a 429 p50 / p99 ms"]


def _row(name: str, g: dict[str, Any]) -> list[Any]:
    other = {code: n for code, n in g["codes"].items() if code not in ("429",)}
    refused = ", ".join(f"{c} {n}" for c, n in sorted(other.items())) if other else ""
    return [name, g["sent"], g["answered"], g["refused_429"], refused or "-", g["lost"],
            None if g["slo_attainment"] is None else round(100 * g["slo_attainment"], 1), g["ttft_p50_ms"],
            g["ttft_p99_ms"], g["tpot_p50_ms"], g["tpot_p99_ms"], g["itl_p50_ms"], g["itl_p99_ms"],
            f"{report.fmt(g['refusal_p50_ms'])} / {report.fmt(g['refusal_p99_ms'])}"]


def _table(rows: list[list[Any]], first: str = "group") -> str:
    return report.markdown_table([first, *GROUP_COLUMNS], rows)


def _load(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Flatfare's runs (the first is compared with vllm serve's; any other is shown after it) and vllm serve's."""
    runs = [json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text()) for p in paths]
    ours = [r for r in runs if r["system"] == "flatfare"]
    if not ours:
        raise SystemExit("no Flatfare run among the files")
    return ours, next((r for r in runs if r["system"] == "vllm"), None)


def admissible_indices(meta: dict[str, Any]) -> set[int]:
    """The replay's requests the plans' rules let through, rebuilt from a run's window and plans."""
    args, w = meta["args"], meta["window"]
    window = schedule.Window(w["start_min"], w["end_min"], w["sample"], w["compression"], w["seed"])
    count = int(args["accounts"])
    sends = schedule.build(schedule.load(), window, count, float(args["zipf"]), float(args["batch_share"]))
    plans = {name: meta["plans"][name] for name in schedule.SEEDED}
    return {s.index for s in schedule.engine_load(sends, schedule.accounts(count), plans)}


def _admissible(ours: dict[str, Any], vllm: dict[str, Any]) -> tuple[float, float]:
    indices = admissible_indices(ours["meta"])
    slo = analysis.Slo(ours["meta"]["slo"]["ttft_s"], ours["meta"]["slo"]["tpot_s"])
    seconds = ours["meta"]["window"]["duration_s"]
    return (analysis.admissible_goodput(ours["phases"]["full"]["records"], indices, slo, seconds),
            analysis.admissible_goodput(vllm["phases"]["full"]["records"], indices, slo, seconds))


def _lanes(label: str, run: dict[str, Any]) -> list[list[Any]]:
    return [_row(f"{label}: {group}, {kind} minutes", run[f"{group}:{kind}"])
            for group in ("premium", "standard", "all") for kind in ("quiet", "busy")]


def _verdict_rows(goals: list[analysis.Goal]) -> list[list[Any]]:
    return [[g.name, g.measured, g.bound, {True: "met", False: "**missed**", None: "shown"}[g.met]] for g in goals]


def _another_run(number: int, run: dict[str, Any], out: Path, name: str) -> tuple[str, str]:
    meta, full = run["meta"], run["phases"]["full"]
    goals = analysis.verdicts(run["phases"], None, run.get("audit"), _resources(run.get("samples", [])))
    text = (f"Trace minutes {meta['window']['start_min']}-{meta['window']['end_min']}, "
            f"{meta['window']['compression']}x faster, {100 * meta['window']['sample']:.1f} % of its requests (capacity "
            f"taken as {meta['capacity']['req_per_s']} req/s, busiest minute at {meta['args']['peak_load']}x it), "
            f"phases {', '.join(run['phases'])}; no vllm serve run beside it.\n\n"
            + report.markdown_table(["goal", "measured", "bound", "verdict"], _verdict_rows(goals)) + "\n\n"
            + _table([_row(key.split(":", 1)[1], g) for key, g in full["groups"].items() if key.startswith("plan:")],
                     "plan") + "\n\n" + _table(_lanes("Flatfare", full["groups"])))
    _plots(out, f"{name}_earlier{number}", run, None)
    text += f"\n\n![governor]({name}_earlier{number}_governor.png)"
    return (f"Earlier run {number}: {meta['card'].split(',')[0]}, {meta['machine'].get('date', '')}, "
            f"commit {meta['machine'].get('flatfare commit', '?')}"), text


def _resources(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("gateway_rss_mib", "main_worker_rss_mib", "fleet_rss_mib", "redis_used_mib", "redis_keys")
    names = {"gateway_rss_mib": "Gateway processes' memory (RSS, MiB)",
             "main_worker_rss_mib": "Main model's worker and engine (RSS, MiB)",
             "fleet_rss_mib": "Fleet supervisor (RSS, MiB)",
             "redis_used_mib": "Redis used memory (MiB)", "redis_keys": "Redis keys"}
    return {names[k]: analysis.flatness(samples, k) for k in keys}


def write(paths: list[Path], out: Path, name: str = "", notes: Path | None = None) -> int:
    runs, vllm = _load(paths)
    ours = runs[0]
    meta = ours["meta"]
    name = name or ("rehearsal_cpu" if meta["card"] == "cpu" else "rehearsal_gpu")
    phases = ours["phases"]
    resources = _resources(ours.get("samples", []))
    admissible = _admissible(ours, vllm) if vllm and "full" in phases else None
    goals = analysis.verdicts(phases, (vllm or {}).get("phases", {}).get("full"), ours.get("audit"), resources,
                              admissible)
    verdict_rows = _verdict_rows(goals)
    window = meta.get("window", {})
    capacity = meta.get("capacity", {})
    intro = (f"The Azure LLM inference trace (conversation, 2023-11-16; Patel et al., \"Splitwise\", ISCA 2024; "
             f"CC-BY 4.0, bench/traces/) replayed through the whole platform on **{meta['card']}**: trace minutes "
             f"{window.get('start_min')}-{window.get('end_min')}, {window.get('compression')}x faster, "
             f"{100 * window.get('sample', 0):.1f} % of its requests (sampled so that the busiest minute loads the "
             f"engine {meta['args'].get('peak_load')}x the capacity measured first, {capacity.get('req_per_s')} "
             f"req/s). {meta['args'].get('accounts')} accounts by bench/rehearsal/schedule.py's rule; main model "
             f"`{meta['main']['name']}` ({json.dumps(meta['main']['options'])})"
             + (f", second model `{meta['second']['name']}` on demand (sleeps after "
                f"{meta['second']['idle_timeout_s']} s idle)" if meta.get("second") else "")
             + f". SLO: TTFT <= {meta['slo']['ttft_s']} s and TPOT <= {1000 * meta['slo']['tpot_s']:.0f} ms. "
             "Reproduce: `bash bench/gpu_device.sh rehearsal ...` on the device (bench/gpu.py plan), then "
             f"`python -m bench rehearsal report` on the JSON. bench/rehearsal/__init__.py says what each phase is.")
    sections: list[tuple[str, str]] = [("Verdicts", report.markdown_table(["goal", "measured", "bound", "verdict"],
                                                                         verdict_rows))]
    if notes is not None:
        sections.append(("What the runs found", notes.read_text()))
    run_rows = [[p, phase.get("live"), phase.get("batch", {}).get("lines", 0), phase.get("replay_s"),
                 phase.get("client_late_p99_s")] for p, phase in phases.items()]
    if vllm:
        v = vllm["phases"]["full"]
        run_rows.append(["vllm serve", v.get("live"), 0, None, v.get("client_late_p99_s")])
    sections.append(("Runs", report.markdown_table(["phase", "live requests", "batch lines", "replay s",
                                                     "client lateness p99 s"], run_rows)
                     + f"\n\nReady in {meta.get('ready_s')} s (Flatfare: gateway, fleet, main engine warm)"
                     + (f", {vllm['meta'].get('ready_s')} s (vllm serve)." if vllm else ".")
                     + " Minutes by the engine's load from the plans' rules (busy: the quarter with the most): "
                     + ", ".join(f"{m} {k} {meta['rates'][m]:.1f}/s" for m, k in sorted(meta["kinds"].items(),
                                                                                         key=lambda i: int(i[0])))))
    full = phases.get("full", {}).get("groups")
    if full:
        plan_rows = [_row(key.split(":", 1)[1], g) for key, g in full.items() if key.startswith("plan:")]
        plan_rows.append(_row("second model", full["second_model"]))
        sections.append(("Per plan (phase full)", _table(plan_rows, "plan")))
        lane_rows = _lanes("Flatfare", full)
        if vllm:
            lane_rows += _lanes("vllm serve", vllm["phases"]["full"]["groups"])
        sections.append(("Premium and standard in the busy and quiet minutes", _table(lane_rows)))
    if full and vllm:
        v = vllm["phases"]["full"]["groups"]
        side = []
        for label, g in (("Flatfare", full), ("vllm serve", v)):
            for part in ("all", "all:busy", "all:quiet"):
                s = g[part]
                side.append([label, part, s.get("goodput_rps"), s.get("output_tok_per_s"), s["slo_attainment"],
                             s["ttft_p50_ms"], s["ttft_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"], s["refused_429"]])
        sections.append(("Side by side with vllm serve (the same live requests of the main model)",
                         report.markdown_table(["system", "minutes", "goodput req/s", "output tok/s", "SLO met",
                                                "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "429"],
                                               side)))
    alone = phases.get("no-heavy", {}).get("groups")
    if full and alone:
        sections.append(("The quiet accounts beside the heaviest, and without them", _table([
            _row("beside the heaviest (full)", full["quiet_accounts"]),
            _row("without them (no-heavy)", alone["quiet_accounts"]),
            _row("the heaviest themselves", full["heavy_accounts"])])))
    no_batch = phases.get("no-batch", {}).get("groups")
    batch = phases.get("full", {}).get("batch")
    if full and no_batch:
        text = _table([_row("with batch lines (full)", full["all"]), _row("without (no-batch)", no_batch["all"])])
        if batch:
            text += (f"\n\nBatch lines: {batch['lines']} in {batch['batches']} files; {batch['completed_in_replay']} "
                     f"completed during the replay, {batch['completed']} by the end of the wait, "
                     f"{batch['cancelled_unfinished']} batches cancelled unfinished. Completed by the minutes they "
                     f"completed in: {batch.get('completed_by_minute')}.")
        sections.append(("Batch lines on idle capacity", text))
    second = full and full["second_model"]
    if second and second["sent"]:
        wakes = _engine_changes(ours.get("samples", []), "second_engine")
        sections.append(("The second model: sleeping and waking under load", (
            f"{second['sent']} requests, {second['answered']} answered, {second['lost']} lost; "
            f"{second['model_waits']} waited for its engine (x-flatfare-model-wait-ms p50 "
            f"{second['model_wait_p50_ms']} "
            f"ms, max {second['model_wait_max_ms']} ms); its engine's states seen over the run: {wakes}.")))
    res_rows = [[k, v["first"], v["last"], f"{100 * v['change']:+.1f} %" if v.get("change") is not None else "-"]
                for k, v in resources.items() if v]
    sections.append(("Memory over the run (first fifth of the samples vs last)",
                     report.markdown_table(["what", "first", "last", "change"], res_rows)))
    if ours.get("audit"):
        a = ours["audit"]
        sections.append(("The money audit (bench/audit.py)", report.markdown_table(
            ["ledger rows", "billable (live)", "billed at a price", "quota units counted", "given back", "outbox",
             "sent", "Stripe kept", "charged twice", "faults"],
            [[a["rows"], a["billable_live"], a["billed"], a["units_counted"], a["units_given_back"], a["outbox"],
              a["outbox_sent"], a["stripe_events"], a["charged_twice"], "; ".join(a["faults"]) or "none"]])))
    out.mkdir(parents=True, exist_ok=True)
    _plots(out, name, ours, vllm)
    sections.append(("Plots", "\n".join(f"![{p}]({name}_{p}.png)" for p in ("goodput", "premium", "governor",
                                                                              "resources"))))
    for number, run in enumerate(runs[1:], start=1):  # older runs, given after this one's files: theirs alone
        sections.append(_another_run(number, run, out, name))
    settings = {k: v for k, v in meta["args"].items() if k not in ("out", "workdir", "paths")}
    info = {**meta["machine"], "card": meta["card"]}
    report.write_markdown(out / f"{name}.md", f"Rehearsal: a real day of traffic on {meta['card']}", intro, info,
                          settings, sections)
    report.write_csv(out / f"{name}.csv", ["goal", "measured", "bound", "verdict"], verdict_rows)
    print((out / f"{name}.md").read_text().split("## Machine")[0])
    print(report.markdown_table(["goal", "measured", "bound", "verdict"], verdict_rows))
    return 0


def _engine_changes(samples: list[dict[str, Any]], key: str) -> str:
    seen: list[str] = []
    for s in samples:
        state = s.get(key)
        if state and (not seen or seen[-1] != state):
            seen.append(state)
    return " -> ".join(seen) if len(seen) < 40 else f"{len(seen)} changes"


def _plots(out: Path, name: str, ours: dict[str, Any], vllm: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = ours["phases"].get("full")
    if full:
        fig, axes = plt.subplots(2, 1, figsize=(8, 6.4), dpi=100, sharex=True)
        runs = [("Flatfare", full["timeline"])]
        if vllm:
            runs.append(("vllm serve", vllm["phases"]["full"]["timeline"]))
        minutes = [row["minute"] for row in full["timeline"]]
        axes[0].plot(minutes, [r["offered_rps"] for r in full["timeline"]], color="grey", label="offered")
        for label, rows in runs:
            axes[0].plot(minutes, [r["good_rps"] for r in rows], marker="o", label=f"{label}: within the SLO")
        axes[0].set_ylabel("requests/s")
        axes[0].set_title("Goodput per trace minute (main model)")
        axes[0].legend(fontsize=8)
        for label, rows in runs:
            axes[1].plot(minutes, [r["standard_ttft_p50_ms"] for r in rows], marker=".", label=f"{label}: standard")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("TTFT p50 ms")
        axes[1].set_xlabel("trace minute")
        axes[1].legend(fontsize=8)
        _shade(axes, ours["meta"]["kinds"])
        fig.tight_layout()
        fig.savefig(out / f"{name}_goodput.png")
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        for label, rows in runs:
            ax.plot(minutes, [r["premium_ttft_p50_ms"] for r in rows], marker="o", label=f"{label}: premium")
        ax.set_yscale("log")
        ax.set_ylabel("TTFT p50 ms")
        ax.set_xlabel("trace minute")
        ax.set_title("Premium's time to first token per trace minute (shaded: busy)")
        ax.legend(fontsize=8)
        _shade([ax], ours["meta"]["kinds"])
        fig.tight_layout()
        fig.savefig(out / f"{name}_premium.png")
        plt.close(fig)
    samples = [s for s in ours.get("samples", []) if "t" in s and "error" not in s]
    if samples:
        t0 = samples[0]["t"]
        xs = [s["t"] - t0 for s in samples]
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        for key, label in (("gateway_rss_mib", "gateways"), ("main_worker_rss_mib", "main worker + engine"),
                           ("redis_used_mib", "Redis used")):
            ax.plot(xs, [s.get(key) for s in samples], label=label)
        ax.set_xlabel("s since the first phase")
        ax.set_ylabel("MiB")
        ax.set_title("Memory over the run")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}_resources.png")
        plt.close(fig)
        governed = [(x, s["main_governor"]) for x, s in zip(xs, samples, strict=True) if s.get("main_governor")]
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        if governed:
            ax.plot([x for x, _ in governed], [g["limit"] for _, g in governed], label="standard limit")
            ax.plot(xs, [s.get("main_inflight") for s in samples], label="jobs held")
            ax2 = ax.twinx()
            ax2.plot([x for x, _ in governed], [g["pace_ms"] for _, g in governed], color="red", alpha=0.6,
                     label="pace ms")
            ax2.plot([x for x, _ in governed], [g["target_ms"] for _, g in governed], color="red", linestyle="--",
                     label="target ms")
            ax2.set_ylabel("ms per output token")
            ax2.legend(fontsize=8, loc="upper right")
        ax.set_xlabel("s since the first phase")
        ax.set_ylabel("jobs")
        ax.set_title("The main worker's pace governor" if governed else "No pace governor on this engine")
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(out / f"{name}_governor.png")
        plt.close(fig)


def _shade(axes: list[Any], kinds: dict[str, str]) -> None:
    for minute, kind in kinds.items():
        if kind == "busy":
            for ax in axes:
                ax.axvspan(int(minute) - 0.5, int(minute) + 0.5, color="orange", alpha=0.12)


