"""Benchmark: what Premium and fair shares sell, under overload caused by others; prefix-aware routing.

One CPU worker (the real engine, the default model) holding ``--capacity`` jobs serves parts 1 and 2;
its capacity in requests/s is measured first (``--capacity`` closed-loop clients). Every client group
has accounts of its own, made through the admin API, and sends streaming chat requests (``ignore_eos``,
``--max-tokens``); time to first token (TTFT) is when the first chunk arrives, the time to a
refusal is until its whole 429 answer is read, both in this process (aiohttp).

1. **Premium under overload caused by others.** ``--premium-accounts`` premium accounts send
   open-loop (Poisson) at ``--premium-share`` of the capacity, first on an idle platform, then
   while ``--standard-accounts`` pro accounts send open-loop at ``--overload`` x the capacity: the
   same premium requests at the same moments both times. Goals (issue 19): premium TTFT p50 and
   p99 within 1.2x of idle, no premium 429, standard's excess refused with 429 + Retry-After in
   under 5 ms (p99).
2. **Noisy neighbour.** ``--neighbours`` pro accounts send open-loop at ``--neighbours-share`` of
   the capacity together, alone, then beside one pro account flooding with ``--flood-clients``
   closed-loop clients (each sends again as soon as it is answered, and waits the Retry-After of a
   refusal, as OpenAI's SDK does). Goals: the neighbours' TTFT p99 within 1.5x of the run without
   the flood; 429s go to the flooder, not to them.
3. **Prefix routing.** Two CPU workers; ``--documents`` long shared system prompts, each asked
   ``--questions`` different questions, in a shuffled order. Time to first token and throughput
   with prefix-aware routing on, then off (plain sharing through the lane), ``--routing-rounds``
   times; the workers start once, the gateway restarts with the switch for each run.

In parts 1 and 2 the engine has the last core to itself and the gateway, Redis and the clients
share the others (``--no-pin``: everything shares every core). The load beside the measured group
(standard, the flood) starts ``--settle`` seconds before the measured window, runs until every
measured request is answered, and is then cut off (its open requests closed: their jobs are
cancelled); the platform is idle before each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import report, scheduling_report
from bench.procs import services
from bench.stack import FlatfareStack, http_get, http_post
from bench.traffic import Group, GroupSummary, Request, RunResult, percentile
from bench.traffic import run as run_traffic

MODEL = "smollm2-135m-instruct"
WORDS = ("river mountain ledger quota lane worker prefix cache token stream gateway batch engine "
         "premium standard request answer window budget invoice model kernel").split()
STANDARD_PLAN = "pro"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=8, help="jobs the worker of parts 1 and 2 holds at once")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of measured load per run")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds the background load runs first")
    parser.add_argument("--calibrate", type=float, default=20.0, help="seconds of the capacity measurement")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--premium-accounts", type=int, default=3)
    parser.add_argument("--premium-share", type=float, default=0.15, help="premium load, fraction of capacity")
    parser.add_argument("--standard-accounts", type=int, default=4)
    parser.add_argument("--overload", type=float, default=2.0, help="standard load, multiple of capacity")
    parser.add_argument("--neighbours", type=int, default=9)
    parser.add_argument("--neighbours-share", type=float, default=0.45, help="the neighbours' load together")
    parser.add_argument("--flood-clients", type=int, default=100)
    parser.add_argument("--premium-reserve", type=int, default=None,
                        help="the worker's FLATFARE_PREMIUM_RESERVE (default: the worker's own default)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="parts 1 and 2: the engine on the last core, gateway, Redis and clients on the others")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--documents", type=int, default=12, help="distinct shared prompts (routing bench)")
    parser.add_argument("--questions", type=int, default=4, help="questions per shared prompt")
    parser.add_argument("--document-words", type=int, default=300)
    parser.add_argument("--routing-concurrency", type=int, default=4)
    parser.add_argument("--routing-rounds", type=int, default=2, help="prefix routing, then plain sharing, n times")
    parser.add_argument("--parts", nargs="+", default=["premium", "noisy", "routing"],
                        choices=["premium", "noisy", "routing"])
    parser.add_argument("--quick", action="store_true", help="smoke run: short durations, few documents")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


# -- the platform --------------------------------------------------------------------------------

@dataclass
class Admin:
    """The bench platform's admin API: accounts of a plan, each with one key."""

    base_url: str
    token: str

    @classmethod
    def bootstrap(cls, stack: FlatfareStack) -> Admin:
        done = subprocess.run(stack._flatfare("admin", "bootstrap"), env=stack.env(), check=True,
                              capture_output=True, text=True, cwd=stack.workdir)
        return cls(f"{stack.base_url}/admin/v1", done.stdout.strip().splitlines()[-1])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = http_post(f"{self.base_url}{path}", self.token, body)
        if status != 201:
            raise RuntimeError(f"POST {path}: {status} {raw[:300]!r}")
        return json.loads(raw)

    def keys(self, prefix: str, plan: str, count: int) -> tuple[str, ...]:
        """``count`` new accounts ``{prefix}-{i}`` on ``plan``: one key each."""
        found = []
        for i in range(count):
            account = self._post("/accounts", {"name": f"{prefix}-{i}", "plan": plan})
            found.append(self._post(f"/accounts/{account['id']}/keys", {"name": prefix})["key"])
        return tuple(found)

    def plans(self) -> dict[str, dict[str, Any]]:
        status, raw = http_get(f"{self.base_url}/plans?limit=200", self.token)
        return {p["name"]: p for p in json.loads(raw)["data"]} if status == 200 else {}


def _say(text: str) -> None:
    print(f"[scheduling {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _wait_idle(stack: FlatfareStack, timeout_s: float = 300) -> None:
    """Until the worker holds no job: the next run starts on a quiet platform."""
    import redis as redis_py

    from flatfare import contract

    client = redis_py.Redis.from_url(stack.redis.url)  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            ids = client.zrange(contract.pool_key(MODEL), 0, -1)
            busy = sum(int(client.hget(contract.worker_key(i.decode()), "inflight") or 0) for i in ids)
            if busy == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker still holds {busy} jobs after {timeout_s:.0f} s")
            time.sleep(0.5)
    finally:
        client.close()
    time.sleep(2.0)  # the heartbeat that said 0 may be a second old


@dataclass
class Run:
    """One measured run of a scenario: its name, its groups and what they got."""

    scenario: str
    name: str
    groups: list[Group]
    result: RunResult

    def summary(self, group: str) -> GroupSummary:
        return GroupSummary.of(self.result.of(group))


def scenarios(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], list[Run]]:
    """Parts 1 and 2 on one platform; the capacity measured, and every run."""
    options = json.dumps({"enforce_eager": True, "dtype": "float32"})
    extra_env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.premium_reserve is not None:
        extra_env["FLATFARE_PREMIUM_RESERVE"] = str(args.premium_reserve)
    runs: list[Run] = []
    cores = sorted(os.sched_getaffinity(0))
    engine_cpus = rest_cpus = None
    if args.pin and len(cores) >= 2:
        # The engine's CPU backend keeps its cores busy even between steps; sharing them, the gateway's
        # refusals would time the engine's spin, not the gateway (a gateway host has its own CPUs).
        engine_cpus, rest_cpus = str(cores[-1]), ",".join(str(c) for c in cores[:-1])
        extra_env["VLLM_CPU_OMP_THREADS_BIND"] = engine_cpus
        os.sched_setaffinity(0, set(cores[:-1]))  # the clients, beside the gateway
    with services() as running:
        stack = FlatfareStack(running, workdir / "scenarios", MODEL,
                              worker_args=["--engine-options", options, "--max-inflight", str(args.capacity)],
                              extra_env=extra_env, gateway_cpus=rest_cpus, worker_cpus=engine_cpus,
                              redis_cpus=rest_cpus)
        try:
            stack.start_storage()
            stack.start_worker()
            stack.start_gateway(ready_timeout_s=900)
            _say("the platform is up")
            admin = Admin.bootstrap(stack)
            request = Request(f"{stack.base_url}/v1/chat/completions", MODEL, args.max_tokens)

            def measure(scenario: str, name: str, groups: list[Group], duration_s: float,
                        settle_s: float = 0.0) -> RunResult:
                _wait_idle(stack)
                _say(f"{scenario}: {name} ({duration_s:.0f} s)")
                result = run_traffic(request, groups, duration_s, settle_s, args.seed)
                runs.append(Run(scenario, name, groups, result))
                return result

            # The capacity: what the worker completes at its slots' worth of clients (the bench
            # account is enterprise: the premium lane, every slot). A short run first warms the engine.
            bench = (stack.key,)
            measure("capacity", "warm-up", [Group("warm-up", bench, clients=args.capacity)], 5.0)
            runs.pop()
            calibration = measure("capacity", "calibration", [Group("calibration", bench, clients=args.capacity)],
                                  args.calibrate)
            done = [o for o in calibration.of("calibration")
                    if o.status == 200 and not o.code and o.sent_s + o.total_s <= args.calibrate]
            capacity_rps = len(done) / args.calibrate
            if capacity_rps <= 0:
                raise RuntimeError("the capacity run completed no request")
            ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
            capacity = {"slots": args.capacity, "req_per_s": capacity_rps,
                        "ttft_p50_ms": (percentile(ttfts, 50) or 0) * 1000,
                        "ttft_p99_ms": (percentile(ttfts, 99) or 0) * 1000, "plans": admin.plans()}

            if "premium" in args.parts:
                premium = Group("premium", admin.keys("premium", "premium", args.premium_accounts),
                                rate=args.premium_share * capacity_rps)
                standard = Group("standard", admin.keys("standard", STANDARD_PLAN, args.standard_accounts),
                                 rate=args.overload * capacity_rps, measured=False)
                measure("premium", "idle platform", [premium], args.duration)
                measure("premium", f"standard at {args.overload:g}x capacity", [standard, premium], args.duration,
                        args.settle)
            if "noisy" in args.parts:
                neighbours = Group("neighbours", admin.keys("neighbour", STANDARD_PLAN, args.neighbours),
                                   rate=args.neighbours_share * capacity_rps)
                flooder = Group("flooder", admin.keys("flooder", STANDARD_PLAN, 1), clients=args.flood_clients,
                                measured=False)
                measure("noisy", "without the flood", [neighbours], args.duration)
                measure("noisy", f"beside a {args.flood_clients}-client flood", [flooder, neighbours],
                        args.duration, args.settle)
        finally:
            stack.stop()
            os.sched_setaffinity(0, set(cores))
    return capacity, runs


# -- prefix routing (part 3) -----------------------------------------------------------------------

async def _first_chunk(session: aiohttp.ClientSession, url: str, key: str, messages: list[dict[str, str]],
                       max_tokens: int) -> tuple[float | None, int]:
    """(time to the first chunk, HTTP status) of one streaming chat request."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    started = time.perf_counter()
    first: float | None = None
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status != 200:
            await response.read()
            return None, response.status
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
    return first, 200


def _documents(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Run {seed}. You are the assistant for project {i}. Reference document follows. "
            + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


async def _routing_run(url: str, key: str, docs: list[str], questions: int, concurrency: int,
                       max_tokens: int, seed: int) -> tuple[list[float], float, int]:
    work = [(doc, q) for doc in docs for q in range(questions)]
    random.Random(seed).shuffle(work)
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    ttfts: list[float] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client() -> None:
            while not queue.empty():
                doc, q = queue.get_nowait()
                messages = [{"role": "system", "content": doc},
                            {"role": "user", "content": f"Question {q}: summarise part {q} in one line."}]
                first, status = await _first_chunk(session, url, key, messages, max_tokens)
                if status == 200 and first is not None:
                    ttfts.append(first)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, time.perf_counter() - started, len(work)


def routing(args: argparse.Namespace, workdir: Path) -> list[list[Any]]:
    """Both workers start once; the gateway restarts with the switch (a gateway setting) for each run."""
    rows: list[list[Any]] = []
    options = json.dumps({"enforce_eager": True, "dtype": "float32", "enable_prefix_caching": True})
    modes = (True, False) * (1 if args.quick else args.routing_rounds)
    with services() as running:
        stack = FlatfareStack(running, workdir / "routing", MODEL, worker_args=["--engine-options", options],
                              extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            stack.start_storage()
            stack.start_worker()
            second = _second_worker(stack, options)
            for round_, prefix_routing in enumerate(modes):
                mode = "prefix routing" if prefix_routing else "plain sharing"
                if stack.gateway is not None:
                    running.stop(stack.gateway)
                stack.extra_env["FLATFARE_PREFIX_ROUTING"] = "true" if prefix_routing else "false"
                stack.start_gateway(ready_timeout_s=900)
                _wait_two_warm(stack)
                _say(f"routing: {mode}, run {round_ + 1}")
                # Fresh documents per run (the run's number opens each): no run profits from another's cache.
                docs = _documents(args.documents, args.document_words, seed=1000 + round_)
                ttfts, seconds, count = asyncio.run(_routing_run(
                    f"{stack.base_url}/v1/chat/completions", stack.key, docs, args.questions,
                    args.routing_concurrency, args.max_tokens, seed=round_))
                rows.append([mode, round_ + 1, count, len(ttfts), _ms(percentile(ttfts, 50)),
                             _ms(percentile(ttfts, 99)), count / seconds])
            running.stop(second)
        finally:
            stack.stop()
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _second_worker(stack: FlatfareStack, options: str):  # noqa: ANN202 - a bench.procs.Service
    from bench.procs import Service

    return stack.services.start(Service("worker-2", stack._flatfare("worker", "--model", MODEL, "--engine-options",
                                                                     options), stack.workdir / "worker-2.log",
                                        env=stack.env(), cwd=str(stack.workdir)))


def _wait_two_warm(stack: FlatfareStack, timeout_s: float = 900) -> None:
    import redis as redis_py

    from flatfare import contract

    client = redis_py.Redis.from_url(stack.redis.url)  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            ids = client.zrange(contract.pool_key(MODEL), 0, -1)
            infos = [client.hgetall(contract.worker_key(i.decode())) for i in ids]
            if sum(1 for f in infos if f and f.get(b"state") == b"warm") >= 2:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("two warm workers never appeared")
            time.sleep(1)
    finally:
        client.close()


# -- the command -----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.settle, args.calibrate, args.documents, args.questions = 10.0, 3.0, 8.0, 4, 3
    report.mark_start()
    info = report.machine()
    started = time.monotonic()
    sections: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="ff-bench-sched-") as tmp:
        workdir = Path(tmp)
        if {"premium", "noisy"} & set(args.parts):
            capacity, runs = scenarios(args, workdir)
            sections += scheduling_report.scenario_sections(args, capacity, runs, args.out)
        if "routing" in args.parts:
            rows = routing(args, workdir)
            columns = ["mode", "run", "requests", "answered", "TTFT p50 ms", "TTFT p99 ms", "req/s"]
            report.write_csv(args.out / "scheduling_routing.csv", columns, rows)
            sections.append(("Prefix-aware routing against plain sharing (2 workers)",
                             report.markdown_table(columns, rows)))
            scheduling_report.plot_routing(args.out / "scheduling_routing.png", rows)
    info["load average at the end"] = report.load_average()
    info["wall time"] = f"{(time.monotonic() - started) / 60:.1f} min"
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    report.write_markdown(args.out / "scheduling.md", "Scheduling: what Premium and fair shares sell; prefix routing",
                          __doc__ or "", info, settings, sections)
    print((args.out / "scheduling.md").read_text())
    return 0
