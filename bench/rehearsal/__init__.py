"""A real day of traffic: a production trace replayed through the whole platform, on mixed plans, beside ``vllm serve``.

``python -m bench rehearsal run`` replays a window of Azure's public conversation trace (bench/traces/,
CC-BY 4.0) through Flatfare as an operator runs it (bench/rehearsal/platform.py: gateway processes,
Redis, the SQL ledger, Stripe's edge, one fleet serving a pinned main model and a second model on
demand, which sleeps and wakes during the run). The trace's requests are spread over a few hundred
accounts by a stated rule (bench/rehearsal/schedule.py: Zipf ranks, the heaviest on Free and Pro, a
handful on Premium, one Enterprise, a share sent as Batch API lines), each with its own key, prompts
of the trace's lengths and outputs forced to them, streamed (bench/rehearsal/client.py). The window is
time-compressed, and sampled so that the busiest minute loads the engine ``--peak-load`` times the
capacity measured first (a closed loop through the priority lane).

Phases, each with accounts of its own (a daily quota spent in one phase would refuse the next):
``full`` (everything), ``no-heavy`` (the heaviest accounts left out: what the quiet accounts get
without them), ``no-batch`` (no batch lines: the live TTFT without them). ``--system vllm`` replays the
``full`` phase's live requests of the main model against ``vllm serve`` with the same model, engine
options and GPU, each request with its engine priority. ``python -m bench rehearsal report`` turns the
JSON of both into bench/results/rehearsal_{gpu,cpu}.md and plots, with the verdict beside each goal
(bench/rehearsal/analysis.py). On the GPU: ``bench/gpu_device.sh rehearsal``; the CPU run is
tests/bench/rehearsal/test_run.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.procs import Service, services
from bench.rehearsal import analysis, schedule
from bench.rehearsal.client import Record, Target, Words, replay
from bench.rehearsal.client import send as send_one
from bench.rehearsal.platform import Model, Platform, batch_lines
from bench.stack import http_get

PHASES = ("full", "no-heavy", "no-batch")
# Per-request prices (micro-USD) the rehearsal's operator meters on the paid plans (0001's former seeds): every
# billable request of theirs is a ledger row with a price, an outbox row and one Stripe meter event.
PRICES = {"pro": 2000, "premium": 1500, "enterprise": 1000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rehearsal_command", required=True)
    run_ = sub.add_parser("run", help="replay the trace through one system; writes its JSON")
    run_.add_argument("--system", choices=["flatfare", "vllm"], default="flatfare")
    run_.add_argument("--out", type=Path, required=True, help="the JSON this run writes")
    run_.add_argument("--workdir", type=Path, default=Path("/tmp/ff-rehearsal"))
    run_.add_argument("--main-name", default="smollm2-135m-instruct")
    run_.add_argument("--main-source", default="builtin:smollm2-135m-instruct",
                      help="a folder, or builtin:NAME (prepared as the worker does)")
    run_.add_argument("--main-options", default='{"enforce_eager": true, "dtype": "float32"}')
    run_.add_argument("--second-name", default="", help="a second model, on demand (empty: none)")
    run_.add_argument("--second-source", default="")
    run_.add_argument("--second-options", default="{}")
    run_.add_argument("--second-idle-timeout", type=int, default=5, help="its engine sleeps after this idle")
    run_.add_argument("--tokenizer", default="", help="tokenizer.json, or its folder (default: the main model's)")
    run_.add_argument("--gpus", default="cpu", help="the fleet's --gpus")
    run_.add_argument("--max-awake", type=int, default=2)
    run_.add_argument("--gateway-processes", type=int, default=2)
    run_.add_argument("--standard-max-wait-s", type=float, default=1.5,
                      help="the standard lane's longest estimated wait before a 429 (the operator's setting: within "
                      "the TTFT SLO, so that what is admitted can still be answered in time)")
    run_.add_argument("--window", type=float, nargs=2, default=[24.0, 58.0], metavar=("START_MIN", "END_MIN"))
    run_.add_argument("--compression", type=float, default=14.0)
    run_.add_argument("--peak-load", type=float, default=1.4, help="the busiest minute's load, x capacity")
    run_.add_argument("--sample", type=float, default=0.0, help="fraction of the trace kept (0: from the capacity)")
    run_.add_argument("--capacity", type=float, default=0.0, help="requests/s (0: measure it)")
    run_.add_argument("--calibrate-clients", type=int, default=256)
    run_.add_argument("--calibrate-s", type=float, default=30.0)
    run_.add_argument("--warm-s", type=float, default=30.0,
                      help="after the capacity, this long at --warm-load x it through the priority lane, so the "
                      "engine's pace at a moderate load is known before the first phase (0: none)")
    run_.add_argument("--warm-load", type=float, default=0.4)
    run_.add_argument("--accounts", type=int, default=300)
    run_.add_argument("--zipf", type=float, default=1.0)
    run_.add_argument("--batch-share", type=float, default=0.08)
    run_.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    run_.add_argument("--prompt-scale", type=float, default=1.0, help="scale the trace's prompt lengths (CPU runs)")
    run_.add_argument("--max-output", type=int, default=0, help="cap the trace's output lengths (CPU runs)")
    run_.add_argument("--batch-wait-s", type=float, default=30.0, help="after the replay, wait for batch lines")
    run_.add_argument("--idle-settle-s", type=float, default=2.0,
                      help="before each phase, this long more once the platform is idle (the tests shorten it)")
    run_.add_argument("--slo-ttft-s", type=float, default=2.0)
    run_.add_argument("--slo-tpot-s", type=float, default=0.1)
    run_.add_argument("--plan-from", type=Path, help="--system vllm: the Flatfare run's JSON (its window and options)")
    run_.add_argument("--end-by", type=float, default=0.0, help="epoch seconds: start no phase that cannot end by then")
    run_.add_argument("--ready-timeout", type=float, default=900.0)
    run_.add_argument("--seed", type=int, default=32)
    rep = sub.add_parser("report", help="tables and plots from the runs' JSON")
    rep.add_argument("paths", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, default=report.RESULTS_DIR)
    rep.add_argument("--name", default="", help="rehearsal_gpu or rehearsal_cpu (default: by the runs' device)")
    rep.add_argument("--notes", type=Path, help="a Markdown file: what the runs found, shown after the verdicts")


def say(text: str) -> None:
    print(f"[rehearsal {time.strftime('%H:%M:%S')}] {text}", flush=True)


def card() -> str:
    """The GPU's name as nvidia-smi gives it, or "cpu"."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "cpu"


class Scheduled:
    """The run's requests: the window, its sends, each account's plan and model, the minutes' kinds."""

    def __init__(self, args: argparse.Namespace, sample: float, plans: dict[str, dict[str, Any]]) -> None:
        self.window = schedule.Window(args.window[0], args.window[1], sample, args.compression, args.seed)
        self.book = schedule.accounts(args.accounts)
        self.sends = schedule.build(schedule.load(), self.window, args.accounts, args.zipf, args.batch_share)
        self.plans = plans
        self.limits = {name: plans[name] for name in schedule.SEEDED} if plans else None
        self.prompt_scale, self.max_output = args.prompt_scale, args.max_output
        load = schedule.engine_load(self.sends, self.book, self.limits)
        self.rates = schedule.per_minute(load, self.window)
        self.kinds = schedule.classify(self.rates)

    def prompt_tokens(self, send: schedule.Send) -> int:
        return max(8, int(send.prompt_tokens * self.prompt_scale))

    def max_tokens(self, send: schedule.Send) -> int:
        account = self.book.get(send.rank)  # rank 0: the platform's own bench account, on Enterprise
        plan = self.plans.get(account.plan if account else "enterprise", {})
        wanted = send.output_tokens if not self.max_output else min(send.output_tokens, self.max_output)
        cap = plan.get("max_output_tokens")
        return max(1, wanted if cap is None else min(wanted, cap))

    def phase(self, name: str) -> list[schedule.Send]:
        if name == "no-heavy":
            return [s for s in self.sends if not self.book[s.rank].heavy]
        if name == "no-batch":
            return [s for s in self.sends if not s.batch]
        return list(self.sends)

    def context(self) -> analysis.Context:
        return analysis.Context({s.index: s.minute for s in self.sends}, self.kinds,
                                frozenset(r for r, a in self.book.items() if a.heavy), 60 / self.window.compression)


def _tokenizer(args: argparse.Namespace, main_dir: str) -> str:
    path = Path(args.tokenizer or main_dir)
    return str(path / "tokenizer.json" if path.is_dir() else path)


def _source(source: str) -> str:
    """A folder: as given; ``builtin:NAME``: prepared as the worker prepares it (flatfare.workers.prepare)."""
    if not source.startswith("builtin:"):
        return source
    from flatfare.settings import CommonSettings
    from flatfare.workers.prepare import resolve_source

    return resolve_source(source, CommonSettings().models_dir, lambda m: say(m))


async def calibrate(url: str, key: str, model: str, sched: Scheduled, words: Words, clients: int,
                    seconds: float) -> dict[str, Any]:
    """Requests/s the engine completes through the priority lane with ``clients`` closed loops, on the trace's
    lengths (the main model's live requests, in order); the first fifth of the time is warm-up."""
    import aiohttp

    pool = [s for s in sched.sends if not s.batch and sched.book[s.rank].model == schedule.MAIN]
    target = Target(url, {0: key}, {schedule.MAIN: model})
    done: list[Record] = []
    rng = random.Random(7)
    t0 = time.perf_counter()
    warm = seconds / 5
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def loop(index: int) -> None:
            n = index
            while time.perf_counter() - t0 < seconds:
                s = pool[n % len(pool)]
                n += clients
                record = Record(s.index, 0, "enterprise", schedule.MAIN, 0.0, max_tokens=sched.max_tokens(s))
                from bench.rehearsal.client import body

                await send_one(session, target, record, body(target, schedule.MAIN, words.prompt(
                    sched.prompt_tokens(s), rng), record.max_tokens, "premium"), t0)
                done.append(record)

        await asyncio.gather(*(loop(i) for i in range(clients)))
    # Requests that ended inside the measured time, whenever they began: counting only those that also began
    # inside it left out every long one in flight at either end (the first GPU run took 8.5 req/s for an
    # engine that served 1.4x that with no queue).
    counted = [r for r in done if r.answered and warm <= r.sent_s + r.total_s <= seconds]
    rps = len(counted) / (seconds - warm)
    tpot = [r.tpot_s for r in counted if r.tpot_s]
    return {"req_per_s": round(rps, 3), "clients": clients, "seconds": seconds, "answered": len(counted),
            "errors": sum(1 for r in done if not r.answered),
            "tpot_p50_ms": round(1000 * (analysis.quantile(tpot, 0.5) or 0), 2)}


async def warm(url: str, key: str, model: str, sched: Scheduled, words: Words, rps: float,
               seconds: float) -> dict[str, Any]:
    """An open loop at ``rps`` for ``seconds`` through the priority lane, on the trace's lengths: the engine at
    a moderate load before the first phase, as a platform that has been serving is (its worker's pace governor
    learns the pace to hold there). What those requests got, in brief."""
    pool = [s for s in sched.sends if not s.batch and sched.book[s.rank].model == schedule.MAIN]
    count = max(1, int(rps * seconds))
    sends = [schedule.Send(i, i / rps, 0, 0, pool[i % len(pool)].prompt_tokens, pool[i % len(pool)].output_tokens)
             for i in range(count)]
    records, _ = await replay(Target(url, {0: key}, {schedule.MAIN: model}), sends, {0: "enterprise"},
                              {0: "premium"}, {0: schedule.MAIN}, words, sched.max_tokens,
                              prompt_tokens=sched.prompt_tokens, seed=5)
    ttft = [r.ttft_s for r in records if r.answered and r.ttft_s is not None]
    tpot = [r.tpot_s for r in records if r.tpot_s]
    return {"req_per_s": round(rps, 3), "seconds": seconds, "answered": len(ttft), "sent": len(records),
            "ttft_p50_ms": round(1000 * (analysis.quantile(ttft, 0.5) or 0), 2),
            "tpot_p50_ms": round(1000 * (analysis.quantile(tpot, 0.5) or 0), 2)}


class Sampler:
    """The platform's resources every ``every_s`` seconds, in a thread, for the whole run."""

    def __init__(self, platform: Platform, every_s: float = 2.0) -> None:
        self.platform, self.every_s = platform, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.platform.sample())
            except Exception as exc:  # noqa: BLE001 - a missed sample is a gap in a plot, not a failed run
                self.samples.append({"t": time.time(), "error": repr(exc)})
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _wait_idle(platform: Platform, settle_s: float = 2.0, timeout_s: float = 180) -> None:
    from flatfare import contract

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with platform.redis() as client:
            queued = sum(int(client.get(contract.queued_key(platform.main.name, lane)) or 0)
                         for lane in contract.LIVE_LANES)
        busy = sum(w.inflight for w in platform.workers())
        if queued == 0 and busy == 0:
            time.sleep(settle_s)
            return
        time.sleep(1.0)
    say(f"the platform was still busy after {timeout_s:.0f} s; the next phase starts anyway")


async def _run_phase(name: str, platform: Platform, sched: Scheduled, keys: dict[int, str], words: Words,
                     args: argparse.Namespace, slo: analysis.Slo) -> dict[str, Any]:
    sends = sched.phase(name)
    live = [s for s in sends if not s.batch]
    models = {schedule.MAIN: platform.main.name}
    if platform.second is not None:
        models[schedule.SECOND] = platform.second.name
    else:
        live = [s for s in live if sched.book[s.rank].model == schedule.MAIN]
    batches: list[tuple[int, str]] = []
    lines = batch_lines([s for s in sends if s.batch], platform.main.name, words, sched.max_tokens, args.seed + 1,
                        sched.prompt_tokens)
    progress: list[dict[str, Any]] = []
    if lines:
        batches = await platform.submit_batches(keys, lines)
    started: list[float] = []
    stop = asyncio.Event()

    async def follow() -> None:
        while not stop.is_set():
            states = await platform.batch_state(keys, batches)
            at = time.perf_counter() - started[0] if started else 0.0
            progress.append({"t": round(at, 2), "completed": sum(s["request_counts"]["completed"] for s in states),
                             "failed": sum(s["request_counts"]["failed"] for s in states)})
            with_timeout = asyncio.create_task(stop.wait())
            await asyncio.wait([with_timeout], timeout=2.0)
            with_timeout.cancel()

    follower = asyncio.create_task(follow()) if batches else None
    target = Target(f"{platform.base_url}/v1/chat/completions", keys, models)
    say(f"{name}: {len(live)} live requests over {sched.window.duration_s:.0f} s, "
        f"{sum(len(v) for v in lines.values())} batch lines")
    records, late = await replay(target, live, {r: a.plan for r, a in sched.book.items()},
                                 {r: a.lane for r, a in sched.book.items()},
                                 {r: a.model for r, a in sched.book.items()}, words, sched.max_tokens,
                                 prompt_tokens=sched.prompt_tokens, seed=args.seed, on_start=started.append)
    replay_s = time.perf_counter() - started[0]
    batch: dict[str, Any] = {}
    if batches:
        deadline = time.monotonic() + args.batch_wait_s
        while time.monotonic() < deadline:
            states = await platform.batch_state(keys, batches)
            if all(s["status"] in ("completed", "failed", "cancelled", "expired") for s in states):
                break
            await asyncio.sleep(2.0)
        stop.set()
        await follower  # type: ignore[misc]
        states = await platform.batch_state(keys, batches)
        unfinished = [(rank, bid) for (rank, bid), s in zip(batches, states, strict=True)
                      if s["status"] == "in_progress"]
        if unfinished:
            await platform.batch_state(keys, unfinished, cancel=True)
        batch = {"lines": sum(len(v) for v in lines.values()), "batches": len(batches),
                 "completed": sum(s["request_counts"]["completed"] for s in states),
                 "failed": sum(s["request_counts"]["failed"] for s in states),
                 "completed_in_replay": max((p["completed"] for p in progress if p["t"] <= replay_s), default=0),
                 "cancelled_unfinished": len(unfinished), "progress": progress,
                 "completed_by_minute": analysis.batch_by_kind(progress, sched.window.start_min,
                                                               sched.window.compression, sched.kinds)}
    ctx = sched.context()
    out = {"replay_s": round(replay_s, 1), "client_late_p99_s": round(late, 4), "live": len(live),
           "groups": analysis.groups(records, ctx, slo, sched.window.duration_s),
           "timeline": analysis.timeline(records, ctx, slo), "batch": batch,
           "records": [r.saved() for r in records]}
    g = out["groups"]
    say(f"{name}: answered {g['all']['answered']}/{g['all']['sent']}, lost {g['all']['lost']}, 429 "
        f"{g['all']['refused_429']}, premium TTFT p50 busy/quiet {g['premium:busy']['ttft_p50_ms']}/"
        f"{g['premium:quiet']['ttft_p50_ms']} ms, goodput {g['all'].get('goodput_rps')} req/s")
    return out


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    tmp.replace(path)


def run_flatfare(args: argparse.Namespace) -> dict[str, Any]:
    slo = analysis.Slo(args.slo_ttft_s, args.slo_tpot_s)
    main_dir = _source(args.main_source)
    main = Model(args.main_name, main_dir, json.loads(args.main_options), pinned=True)
    second = Model(args.second_name, _source(args.second_source), json.loads(args.second_options),
                   idle_timeout_s=args.second_idle_timeout) if args.second_name else None
    data: dict[str, Any] = {"system": "flatfare", "meta": {
        "card": card(), "machine": report.machine(), "args": {k: str(v) for k, v in vars(args).items()},
        "main": {"name": main.name, "options": main.options}, "second": second and
        {"name": second.name, "options": second.options, "idle_timeout_s": second.idle_timeout_s},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}, "phases": {}}
    env = {"FLATFARE_MAX_QUEUE_WAIT_S_STANDARD": str(args.standard_max_wait_s)}
    with services() as group:
        platform = Platform(group, args.workdir, main, second, args.gateway_processes, args.gpus, args.max_awake, env)
        try:
            ready_s = platform.start(args.ready_timeout)
            say(f"the platform is up in {ready_s:.0f} s")
            data["meta"]["ready_s"] = round(ready_s, 1)
            platform.price(PRICES)
            plans = platform.plans()
            data["meta"]["plans"] = plans
            words = Words.from_tokenizer(_tokenizer(args, main_dir))
            sample = args.sample
            probe = Scheduled(args, sample or 1.0, plans)
            if not sample:
                capacity = args.capacity and {"req_per_s": args.capacity}
                if not capacity:
                    capacity = asyncio.run(calibrate(f"{platform.base_url}/v1/chat/completions", platform.stack.key,
                                                     main.name, probe, words, args.calibrate_clients, args.calibrate_s))
                data["meta"]["capacity"] = capacity
                say(f"capacity {capacity['req_per_s']} req/s")
                sample = schedule.sample_for(schedule.load(), probe.window, capacity["req_per_s"], args.peak_load,
                                             args.accounts, args.zipf, args.batch_share, probe.limits)
            if args.warm_s > 0 and data["meta"].get("capacity"):
                data["meta"]["warm"] = asyncio.run(warm(f"{platform.base_url}/v1/chat/completions", platform.stack.key,
                                                        main.name, probe, words,
                                                        args.warm_load * data["meta"]["capacity"]["req_per_s"],
                                                        args.warm_s))
                say(f"warm-up: {data['meta']['warm']}")
            sched = Scheduled(args, sample, plans)
            data["meta"].update(window={"start_min": sched.window.start_min, "end_min": sched.window.end_min,
                                        "sample": sample, "compression": sched.window.compression,
                                        "seed": sched.window.seed, "duration_s": sched.window.duration_s},
                                rates=sched.rates, kinds=sched.kinds,
                                accounts={r: a.plan for r, a in sched.book.items()})
            keys = {name: asyncio.run(platform.accounts(f"rh{i}", sched.book)) for i, name in enumerate(args.phases)}
            with Sampler(platform) as sampler:
                for name in args.phases:
                    needed = sched.window.duration_s + args.batch_wait_s + 60
                    if args.end_by and time.time() + needed > args.end_by:
                        say(f"{name}: skipped, {args.end_by - time.time():.0f} s left and it needs ~{needed:.0f}")
                        continue
                    _wait_idle(platform, args.idle_settle_s)
                    data["phases"][name] = asyncio.run(_run_phase(name, platform, sched, keys[name], words, args, slo))
                    data["samples"] = sampler.samples
                    _write(args.out, data)
                deadline = time.monotonic() + 120
                while not platform.outbox_settled() and time.monotonic() < deadline:
                    time.sleep(1.0)
            data["samples"] = sampler.samples
            data["audit"] = platform.audit()
            say(f"audit: {data['audit']['faults'] or 'exact'}")
        finally:
            platform.stop()
    _write(args.out, data)
    return data


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    from bench.engine import vllm_serve_argv
    from bench.procs import free_port

    if args.plan_from is None:
        raise SystemExit("--system vllm needs --plan-from: the Flatfare run's JSON (its window and options)")
    ours = json.loads(args.plan_from.read_text())
    meta = ours["meta"]
    slo = analysis.Slo(meta["slo"]["ttft_s"], meta["slo"]["tpot_s"])
    args.window = [meta["window"]["start_min"], meta["window"]["end_min"]]
    args.compression, args.seed = meta["window"]["compression"], meta["window"]["seed"]
    sched = Scheduled(args, meta["window"]["sample"], meta["plans"])
    main_dir = _source(args.main_source)
    options = {**meta["main"]["options"], "scheduling_policy": "priority"}
    data: dict[str, Any] = {"system": "vllm", "meta": {"card": card(), "machine": report.machine(),
                                                      "options": options, "window": meta["window"],
                                                      "slo": meta["slo"]}, "phases": {}}
    words = Words.from_tokenizer(_tokenizer(args, main_dir))
    live = [s for s in sched.phase("full") if not s.batch and sched.book[s.rank].model == schedule.MAIN]
    with services() as group:
        port = free_port()
        started = time.monotonic()
        server = group.start(Service("vllm-serve", vllm_serve_argv(Path(main_dir), meta["main"]["name"], port, options),
                                     args.workdir / "vllm_serve.log", cwd=str(report.REPO_ROOT)))
        server.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, args.ready_timeout)
        data["meta"]["ready_s"] = round(time.monotonic() - started, 1)
        say(f"vllm serve is up in {data['meta']['ready_s']:.0f} s; {len(live)} live requests")
        target = Target(f"http://127.0.0.1:{port}/v1/chat/completions", {}, {schedule.MAIN: meta["main"]["name"]})
        records, late = asyncio.run(replay(target, live, {r: a.plan for r, a in sched.book.items()},
                                           {r: a.lane for r, a in sched.book.items()},
                                           {r: a.model for r, a in sched.book.items()}, words, sched.max_tokens,
                                           prompt_tokens=sched.prompt_tokens, seed=args.seed))
        ctx = sched.context()
        data["phases"]["full"] = {"client_late_p99_s": round(late, 4), "live": len(live),
                                  "groups": analysis.groups(records, ctx, slo, sched.window.duration_s),
                                  "timeline": analysis.timeline(records, ctx, slo),
                                  "records": [r.saved() for r in records]}
        g = data["phases"]["full"]["groups"]
        say(f"vllm serve: answered {g['all']['answered']}/{g['all']['sent']}, premium TTFT p50 busy/quiet "
            f"{g['premium:busy']['ttft_p50_ms']}/{g['premium:quiet']['ttft_p50_ms']} ms, goodput "
            f"{g['all'].get('goodput_rps')} req/s")
    _write(args.out, data)
    return data


def run(args: argparse.Namespace) -> int:
    report.mark_start()
    if args.rehearsal_command == "report":
        from bench.rehearsal import results

        return results.write(args.paths, args.out, args.name, args.notes)
    # A fresh folder each run: a ledger, catalog and admin token left by an earlier run would be taken up (the
    # second GPU attempt stopped at `flatfare admin bootstrap`, which refuses a database that has an admin).
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    data = run_flatfare(args) if args.system == "flatfare" else run_vllm(args)
    if data["system"] == "flatfare":
        lost = sum(p["groups"]["all"]["lost"] for p in data["phases"].values())
        return 0 if not lost and data.get("audit", {}).get("faults") == [] else 1
    return 0
