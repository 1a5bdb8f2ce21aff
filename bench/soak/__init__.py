"""A soak: an hour at a steady share of capacity, with restarts, batches and key rotations. Does anything grow?

``python -m bench soak`` starts the fault benchmark's platform (bench/faults.py ``Rig``: two gateway
processes, two workers, Redis, SQLite or a private PostgreSQL, Stripe's edge), measures its capacity
(answering and billing each request, through one chaos restart: ``_capacity``), then sends ``--load``
of it as an open loop for ``--minutes``: half of the requests streamed, 3 % hung up after the first
chunk, 3 % retried with the same Idempotency-Key (bench/soak/load.py). Every ``--batch-every-s`` a Batch
API file goes in, every ``--rotate-every-s`` the account's key is rotated through the admin API, and
every ``--chaos-every-s`` the first gateway and the first worker are restarted as a rolling deploy does
(drained with SIGTERM, started again).

Every ``--sample-s`` it reads each process's RSS, CPU, open file descriptors, threads and asyncio tasks
(and the load generator's own CPU), Redis' memory and keys, the database's connections and the billing
outbox's backlog;
bench/soak/windows.py turns them into per-window means beside the latency p50/p99 and says whether each
stayed flat after the warm-up. At the end the platform settles and the money is audited
(bench/audit.py): 0 lost, nothing charged twice, counted = ledger = outbox = Stripe. Writes
bench/results/soak.md, soak.csv and soak.png; tests/bench/test_soak.py runs
half a minute of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.faults import RESULTS, Rig, Shape
from bench.procs import Services
from bench.soak import load
from bench.soak.windows import Verdict, Window, verdicts, windows

# Keys of one kind without an expiry may differ by this much between two looks (one being written).
UNEXPIRING_SLACK = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the load runs")
    parser.add_argument("--window-s", type=float, default=300.0, help="the report's windows")
    parser.add_argument("--warmup-windows", type=int, default=2,
                        help="windows left out of the verdicts (at least the replies' and cancels' TTL, 600 s)")
    parser.add_argument("--load", type=float, default=0.7, help="the share of the measured capacity sent")
    parser.add_argument("--capacity-s", type=float, default=30.0,
                        help="how long the closed loop measures (through one chaos restart, if there are any)")
    parser.add_argument("--chaos-every-s", type=float, default=240.0, help="restart a gateway and a worker (0: never)")
    parser.add_argument("--batch-every-s", type=float, default=120.0, help="a Batch API file (0: never)")
    parser.add_argument("--batch-lines", type=int, default=20)
    parser.add_argument("--rotate-every-s", type=float, default=300.0, help="rotate the key (0: never)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--engine", choices=["instant", "vllm"], default="instant")
    parser.add_argument("--postgres", action="store_true", help="a private PostgreSQL instead of SQLite")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flatfare-soak"))
    parser.add_argument("--idempotency-window-s", type=int, default=600,
                        help="the gateways' FLATFARE_IDEMPOTENCY_WINDOW_S (24 h in production): shorter than the "
                        "soak, so the answers kept for retries reach their steady state within it")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="soak")


def run(args: argparse.Namespace) -> int:
    report.mark_start()
    shutil.rmtree(args.workdir, ignore_errors=True)
    services = Services()
    rig = Rig(args.workdir, services, engine=args.engine, workers=2, gateways=2, postgres=args.postgres,
              shape=Shape(tokens=8, token_delay_s=0.02), request_timeout_s=30.0,
              idempotency_window_s=args.idempotency_window_s)
    try:
        rig.start()
        admin_token = subprocess.run([sys.executable, "-m", "flatfare", "admin", "bootstrap"], env=rig.env(),
                                     cwd=rig.workdir, check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1]
        result = asyncio.run(_soak(rig, args, admin_token))
        audit = rig.settle(120.0)
        result["audit"] = {"clean": audit.clean, "faults": audit.faults(), "rows": audit.rows,
                           "billed": audit.billed, "outbox": audit.outbox, "stripe_events": audit.stripe_events,
                           "charged_twice": audit.charged_twice}
    finally:
        rig.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.workdir / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))
    ok = write(result, args)
    return 0 if ok else 1


async def _capacity(rig: Rig, seconds: float, restart: bool) -> dict[str, Any]:
    """What the platform sustains, measured on the soak's clients. Each request is answered and then billed
    (a meter event the outbox sends), and on one machine the two share the cores, so the capacity is the
    rate doing both: 1 / (1/answers + 1/events), from the answers a second of a closed loop of 32, through
    one chaos restart (gateway0 and worker0, begun a third of the way in) when the soak restarts, and the
    meter events a second the outbox then delivers from the backlog the loop left (a third of ``seconds``,
    nothing else sent). A load that is a share of the answers alone, measured without restarts, left too
    little to catch up after each (every soak on two cores collapsed), and one past what the outbox keeps
    up with leaves a backlog that grows for the whole soak. The loop runs ``seconds`` and at least until
    the restart is over."""
    clients = load.SoakClients(rig, load.Mix(disconnect=0.0, retry=0.0), time.monotonic())
    started = clients.started
    restarted = asyncio.Event()
    if not restart:
        restarted.set()
    closed = asyncio.create_task(clients.closed_loop(
        32, lambda: restarted.is_set() and time.monotonic() - started > seconds))
    quiet = None
    try:
        if restart:
            await asyncio.sleep(seconds / 3)
            quiet = clients.tally.answered / (time.monotonic() - started)
            await _chaos(rig, clients, started)
            restarted.set()
        await closed
    finally:
        restarted.set()
        await clients.close()
    elapsed = time.monotonic() - started
    tally = clients.tally
    answers = tally.answered / elapsed
    drain_began, sent_before = time.monotonic(), await asyncio.to_thread(_meter_events, rig, "sent")
    await asyncio.sleep(seconds / 3)
    outbox = (await asyncio.to_thread(_meter_events, rig, "sent") - sent_before) / (time.monotonic() - drain_began)
    both = 1 / (1 / answers + 1 / outbox) if answers and outbox else 0.0
    return {"rps": both, "answers_rps": answers, "quiet_rps": quiet, "outbox_rps": outbox,
            "backlog_left": await asyncio.to_thread(_meter_events, rig, "pending"), "window_s": round(elapsed, 1),
            "restarts": clients.events.restarts, "chaos_errors": clients.events.chaos_errors,
            "answered": tally.answered, "failed": dict(tally.failed), "cut": tally.cut, "lost": tally.lost,
            "lost_examples": tally.lost_examples}


def _meter_events(rig: Rig, status: str) -> int:
    return int(rig.sql("SELECT count(*) FROM usage_outbox WHERE status = :status", status=status)[0][0])


async def _soak(rig: Rig, args: argparse.Namespace, admin_token: str) -> dict[str, Any]:
    measured = await _capacity(rig, args.capacity_s, restart=args.chaos_every_s > 0)
    capacity = measured["rps"]
    rate = args.load * capacity
    quiet = f", {measured['quiet_rps']:.1f} before the restart" if measured["quiet_rps"] else ""
    print(f"[soak] capacity {capacity:.1f} req/s: answers {measured['answers_rps']:.1f}/s over "
          f"{measured['window_s']:g} s{quiet}, meter events {measured['outbox_rps']:.1f}/s (then "
          f"{measured['backlog_left']} pending); sending {rate:.1f} req/s "
          f"for {args.minutes:g} min", flush=True)
    started = time.monotonic()
    end_s = args.minutes * 60
    clients = load.SoakClients(rig, load.Mix(), started)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    database_file = "" if args.postgres else str(rig.workdir / "flatfare.db")

    def sampler() -> None:
        while not stop.is_set():
            samples.append(load.sample(rig, time.monotonic() - started, database_file))
            stop.wait(args.sample_s)

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    chores = [asyncio.create_task(_every(args.batch_every_s, end_s, started,
                                         lambda: load.submit_batch(clients, args.batch_lines))),
              asyncio.create_task(_every(args.rotate_every_s, end_s, started,
                                         lambda: load.rotate_key(clients, admin_token, int(args.chaos_every_s) + 60))),
              asyncio.create_task(_every(args.chaos_every_s, end_s, started, lambda: _chaos(rig, clients, started)))]
    try:
        await clients.open_loop_until(rate, end_s)
        print("[soak] load ended; waiting for the chores and the batches", flush=True)
        await asyncio.gather(*chores)
        batches = await _batches_done(clients, deadline_s=120)
    finally:
        stop.set()
        watcher.join()
        await clients.close()
    tally = clients.tally
    print(f"[soak] sent {tally.sent}: answered {tally.answered}, failed {sum(tally.failed.values())}, cut "
          f"{tally.cut}, lost {tally.lost}", flush=True)
    return {"capacity_rps": capacity, "capacity": measured, "rate_rps": rate, "end_s": end_s,
            "tally": {"sent": tally.sent, "answered": tally.answered, "failed": dict(tally.failed), "cut": tally.cut,
                      "lost": tally.lost, "lost_examples": tally.lost_examples},
            "events": vars(clients.events), "batches": batches,
            "done": [vars(d) for d in clients.done], "samples": samples}


async def _every(period_s: float, end_s: float, started: float, chore: Any) -> None:
    """``chore()`` at each multiple of ``period_s`` before ``end_s``; one that overran skips the ticks it missed."""
    if period_s <= 0:
        return
    tick = 1
    while tick * period_s < end_s:
        await asyncio.sleep(max(started + tick * period_s - time.monotonic(), 0))
        await chore()
        tick = max(tick + 1, math.ceil((time.monotonic() - started) / period_s))


async def _chaos(rig: Rig, clients: load.SoakClients, started: float) -> None:
    for name, restart in (("gateway0", load.restart_gateway), ("worker0", load.restart_worker)):
        try:
            began = time.monotonic()
            await asyncio.to_thread(restart, rig, 0)
            clients.events.restarts.append((round(began - started, 1), name))
            print(f"[soak] {began - started:.0f} s: {name} restarted ({time.monotonic() - began:.1f} s)", flush=True)
        except RuntimeError as exc:
            clients.events.chaos_errors.append(f"{name} did not come back: {exc}"[:300])


async def _batches_done(clients: load.SoakClients, deadline_s: float) -> dict[str, Any]:
    """Wait for every batch to end; how many lines each finished."""
    until = time.monotonic() + deadline_s
    ends: dict[str, Any] = {}
    while time.monotonic() < until and len(ends) < len(clients.events.batches):
        for batch_id in clients.events.batches:
            if batch_id in ends:
                continue
            response = await clients._client.get(f"http://127.0.0.1:{clients._port()}/v1/batches/{batch_id}",
                                                 headers={"Authorization": f"Bearer {clients.rig.key}"})
            body = response.json()
            if body.get("status") in ("completed", "failed", "expired", "cancelled"):
                ends[batch_id] = {"status": body["status"], **body.get("request_counts", {})}
        if len(ends) < len(clients.events.batches):  # some still run: look again shortly
            await asyncio.sleep(0.25)
    return {"submitted": len(clients.events.batches), "ended": ends,
            "lines_done": sum(e.get("completed", 0) for e in ends.values())}


# -- the report -------------------------------------------------------------------------------------


def write(result: dict[str, Any], args: argparse.Namespace) -> bool:
    done = [load.Done(**d) for d in result["done"]]
    rows = windows(done, result["samples"], args.window_s, result["end_s"], result["events"]["dropped"])
    judged = verdicts(rows, args.warmup_windows)
    tally, audit, events, batches = result["tally"], result["audit"], result["events"], result["batches"]
    from_s = rows[min(args.warmup_windows, len(rows) - 1)].start_s
    leaks = unexpiring_growth(result["samples"], from_s)
    capacity = result.get("capacity", {})
    ok = (tally["lost"] == 0 and not capacity.get("lost") and not events["dropped"] and audit["clean"]
          and events["replay_mismatch"] == 0 and not leaks and batches["submitted"] == len(batches["ended"])
          and all(v.ok is not False for v in judged))
    names = [name for name in rows[0].means]
    cpus = [name for name in rows[0].cpu_pct]
    window_rows = [[w.index, f"{w.start_s / 60:g}-{w.end_s / 60:g}", w.requests, w.answered, w.dropped, _n(w.p50_ms),
                    _n(w.p99_ms), *(_n(w.cpu_pct[n]) for n in cpus), *(_n(w.means[n]) for n in names)]
                   for w in rows]
    failed = ", ".join(f"{code} x{n}" for code, n in sorted(tally["failed"].items())) or "none"
    sections = [
        ("Verdicts", report.markdown_table(
            ["what", "first window after warm-up", "last window", "change", "bound", "verdict"],
            [[v.what, _n(v.first), _n(v.last), v.change, v.bound, _verdict(v)] for v in judged])),
        ("Per window", report.markdown_table(["window", "minutes", "requests", "answered",
                                              f"dropped ({load.MAX_IN_FLIGHT} in flight)", "p50 ms", "p99 ms",
                                              *(f"{n} CPU %" for n in cpus), *names], window_rows)),
        ("Requests and money", report.markdown_table(
            ["sent", "dropped at the client", "answered", "failed cleanly", "cut (restarted gateway)", "lost",
             "hung up", "retried (replays that named another request)", "key rotations", "restarts",
             "batches (lines done)", "ledger rows",
             "billed", "outbox", "Stripe kept", "charged twice", "audit"],
            [[tally["sent"], len(events["dropped"]), tally["answered"], failed, tally["cut"], tally["lost"],
              events["disconnected"],
              f"{events['retried']} ({events['replay_mismatch']})", events["rotations"], len(events["restarts"]),
              f"{len(batches['ended'])}/{batches['submitted']} ({batches['lines_done']})", audit["rows"],
              audit["billed"], audit["outbox"], audit["stripe_events"], audit["charged_twice"],
              "; ".join(audit["faults"]) or "exact"]])),
    ]
    sections.append(("Redis keys by kind (ids taken out), first window after the warm-up vs the end",
                     _key_growth(result["samples"], from_s) + "\n\nKinds without an expiry that grew: "
                     + (", ".join(f"`{k}` +{n}" for k, n in leaks.items()) or "none")))
    if events["chaos_errors"]:
        sections.append(("What went wrong around the chores", "\n".join(f"- {e}" for e in events["chaos_errors"])))
    if events.get("lost"):
        restarts = ", ".join(f"{name} at {at:g} s" for at, name in events["restarts"])
        lost_rows = [[e["at_s"], e["gateway"], e["pid"], e["why"]] for e in events["lost"]]
        sections.append(("Lost requests: where and when", report.markdown_table(
            ["at s", "gateway", "pid then", "why"], lost_rows) + f"\n\nRestarts: {restarts or 'none'}."))
    _plot(args.out / f"{args.name}.png", rows, result)
    sections.append(("Plot", f"![resources and latency per window]({args.name}.png)"))
    through = (f" through a restart of gateway0 and worker0 ({capacity['quiet_rps']:.1f} before it; "
               f"{capacity['lost']} lost, {capacity['cut']} cut)" if capacity.get("quiet_rps") else "")
    measured = (f", answering and billing: 1 / (1/{capacity['answers_rps']:.1f} + 1/{capacity['outbox_rps']:.1f}) from "
                f"the answers a second over {capacity['window_s']:g} s{through} and the meter events a second the "
                f"billing outbox delivered from the backlog the loop left ({capacity['backlog_left']} rows still "
                "pending after)" if capacity else "")
    intro = (f"{args.minutes:g} minutes at {args.load:.0%} of the capacity measured first with a closed loop of 32 "
             f"({result['capacity_rps']:.1f} req/s{measured}; so {result['rate_rps']:.1f} req/s), "
             f"{args.engine} engine, "
             f"{'PostgreSQL' if args.postgres else 'SQLite'}; a gateway and a worker restarted every "
             f"{args.chaos_every_s:g} s, a batch every {args.batch_every_s:g} s, the key rotated every "
             f"{args.rotate_every_s:g} s. Growth is judged on the gateway and worker that ran throughout "
             f"(gateway1, worker1). Overall: **{'met' if ok else 'NOT met'}**. Written by `python -m bench soak` "
             "(bench/soak/).")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
    report.write_markdown(args.out / f"{args.name}.md", "Soak: does anything grow?", intro, report.machine(),
                          settings, sections)
    report.write_csv(args.out / f"{args.name}.csv", ["window", "start_s", "requests", "answered", "dropped", "p50_ms",
                                                      "p99_ms", *(f"{n} CPU %" for n in cpus), *names],
                     [[w.index, w.start_s, w.requests, w.answered, w.dropped, w.p50_ms, w.p99_ms,
                       *(w.cpu_pct[n] for n in cpus), *(w.means[n] for n in names)]
                      for w in rows])
    print((args.out / f"{args.name}.md").read_text().split("## Machine")[0], flush=True)
    return ok


def _key_growth(samples: list[dict[str, Any]], from_s: float) -> str:
    first = next((s for s in samples if s["at_s"] >= from_s), samples[0])["redis_kinds"]
    last = samples[-1]["redis_kinds"]
    none = [0, 0]
    kinds = sorted(set(first) | set(last), key=lambda k: (-(last.get(k, none)[1] - first.get(k, none)[1]),
                                                          -(last.get(k, none)[0] - first.get(k, none)[0]), k))
    return report.markdown_table(
        ["kind", "keys first", "keys last", "change", "without expiry first", "without expiry last"],
        [[f"`{k}`", first.get(k, none)[0], last.get(k, none)[0], f"{last.get(k, none)[0] - first.get(k, none)[0]:+d}",
          first.get(k, none)[1], last.get(k, none)[1]] for k in kinds])


def unexpiring_growth(samples: list[dict[str, Any]], from_s: float) -> dict[str, int]:
    """Kinds of Redis keys without an expiry that grew from ``from_s`` to the end (a leak, whatever the TTLs)."""
    first = next((s for s in samples if s["at_s"] >= from_s), samples[0])["redis_kinds"]
    last = samples[-1]["redis_kinds"]
    grown = {k: v[1] - first.get(k, [0, 0])[1] for k, v in last.items()}
    return {k: n for k, n in grown.items() if n > UNEXPIRING_SLACK}


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def _verdict(v: Verdict) -> str:
    return "not measured" if v.ok is None else "flat" if v.ok and v.what != "latency p99 ms" else \
        "held" if v.ok else "GREW" if v.what != "latency p99 ms" else "DRIFTED"


def _plot(path: Path, rows: list[Window], result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["at_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), dpi=100, sharex=True)
    for role in load.ROLES:
        axes[0][0].plot(minutes, [s[role]["rss_mib"] for s in samples], label=role)
        axes[0][1].plot(minutes, [s[role]["fds"] for s in samples], label=role)
    axes[0][0].set_ylabel("RSS MiB (with children)")
    axes[0][1].set_ylabel("open file descriptors")
    axes[1][0].plot(minutes, [s["redis_mib"] for s in samples], label="Redis MiB")
    axes[1][0].plot(minutes, [s["redis_keys"] / 1000 for s in samples], label="Redis keys (thousands)")
    axes[1][0].plot(minutes, [s["db_connections"] for s in samples], label="database connections")
    mids = [(w.start_s + w.end_s) / 120 for w in rows]
    axes[1][1].plot(mids, [w.p50_ms for w in rows], marker="o", label="p50")
    axes[1][1].plot(mids, [w.p99_ms for w in rows], marker="o", label="p99")
    axes[1][1].set_ylabel("latency ms")
    for at_s, name in result["events"]["restarts"]:
        for ax in axes.flat:
            ax.axvline(at_s / 60, color="grey", alpha=0.3, linewidth=0.8)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("minutes (grey: a restart)")
    fig.suptitle("Soak: resources and latency (grey lines: gateway0 and worker0 restarted)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
