"""Benchmark: the priority lane under 2x overload, and prefix-aware routing against plain sharing.

1. **Lanes.** One CPU worker (the real engine, the default model) holding ``--capacity`` jobs; as
   many premium as standard closed-loop clients, together twice its capacity. Time to first token
   per lane, with Flatfare's lanes on, against the same load when every client is standard (what a
   gateway without lanes does).
2. **Prefix routing.** Two CPU workers; ``--documents`` long shared system prompts, each asked
   ``--questions`` different questions, in a shuffled order. Time to first token and throughput
   with prefix-aware routing on, then off (plain sharing through the lane).

Both use the streaming chat endpoint, ``ignore_eos`` and a fixed ``max_tokens``; the client is
``aiohttp`` in this process (it measures when the first content chunk arrives).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import report
from bench.procs import services
from bench.stack import FlatfareStack

MODEL = "smollm2-135m-instruct"
WORDS = ("river mountain ledger quota lane worker prefix cache token stream gateway batch engine "
         "premium standard request answer window budget invoice model kernel").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=8, help="jobs the lanes worker holds at once")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load per lanes run")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--documents", type=int, default=16, help="distinct shared prompts (routing bench)")
    parser.add_argument("--questions", type=int, default=4, help="questions per shared prompt")
    parser.add_argument("--document-words", type=int, default=300)
    parser.add_argument("--routing-concurrency", type=int, default=4)
    parser.add_argument("--parts", nargs="+", default=["lanes", "routing"], choices=["lanes", "routing"])
    parser.add_argument("--quick", action="store_true", help="smoke run: short durations, few documents")
    parser.add_argument("--out", type=Path, default=report.RESULTS_DIR)


async def _ttft(session: aiohttp.ClientSession, url: str, key: str, messages: list[dict[str, str]],
                max_tokens: int) -> tuple[float | None, float, int]:
    """(time to first content chunk, total time, HTTP status) of one streaming chat request."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    started = time.perf_counter()
    first: float | None = None
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status != 200:
            await response.read()
            return None, time.perf_counter() - started, response.status
        async for line in response.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                first = time.perf_counter() - started
    return first, time.perf_counter() - started, 200


def _pcts(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    return statistics.median(ordered) * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def _closed_loop(url: str, keys: dict[str, str], clients: dict[str, int], duration_s: float,
                       max_tokens: int) -> dict[str, list[float]]:
    """``clients[name]`` clients per group, each sending one request after another for ``duration_s``."""
    ttfts: dict[str, list[float]] = {name: [] for name in clients}
    deadline = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(name: str, index: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                n += 1
                messages = [{"role": "user", "content": f"Client {name}-{index}, request {n}: say something."}]
                first, _, status = await _ttft(session, url, keys[name], messages, max_tokens)
                if status == 200 and first is not None:
                    ttfts[name].append(first)

        await asyncio.gather(*(client(name, i) for name, count in clients.items() for i in range(count)))
    return ttfts


def _key(stack: FlatfareStack, account: str, plan: str) -> str:
    import subprocess

    done = subprocess.run(stack._flatfare("keys", "create", "--account", account, "--plan", plan), env=stack.env(),
                          check=True, capture_output=True, text=True, cwd=stack.workdir)
    return done.stdout.strip().splitlines()[-1]


def lanes(args: argparse.Namespace, workdir: Path) -> list[list[Any]]:
    rows: list[list[Any]] = []
    options = json.dumps({"enforce_eager": True, "dtype": "float32"})
    with services() as running:
        stack = FlatfareStack(running, workdir / "lanes", MODEL,
                              worker_args=["--engine-options", options, "--max-inflight", str(args.capacity)],
                              extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            stack.start_storage()
            stack.start_worker()
            stack.start_gateway(ready_timeout_s=900)
            keys = {"premium": _key(stack, "bench-premium", "premium"), "standard": _key(stack, "bench-std", "pro")}
            url = f"{stack.base_url}/v1/chat/completions"
            half = args.capacity  # premium + standard clients = 2 x capacity
            for mode in ("lanes on", "no lanes"):
                group_keys = keys if mode == "lanes on" else {"premium": keys["standard"], "standard": keys["standard"]}
                ttfts = asyncio.run(_closed_loop(url, group_keys, {"premium": half, "standard": half},
                                                 args.duration, args.max_tokens))
                for group in ("premium", "standard"):
                    p50, p99 = _pcts(ttfts[group])
                    rows.append([mode, group, half, len(ttfts[group]), p50, p99])
        finally:
            stack.stop()
    return rows


def _documents(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"You are the assistant for project {i}. Reference document follows. "
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
                first, _, status = await _ttft(session, url, key, messages, max_tokens)
                if status == 200 and first is not None:
                    ttfts.append(first)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, time.perf_counter() - started, len(work)


def routing(args: argparse.Namespace, workdir: Path) -> list[list[Any]]:
    rows: list[list[Any]] = []
    options = json.dumps({"enforce_eager": True, "dtype": "float32", "enable_prefix_caching": True})
    with services() as running:
        for round_, prefix_routing in enumerate((True, False, True, False) if not args.quick else (True, False)):
            mode = "prefix routing" if prefix_routing else "plain sharing"
            stack = FlatfareStack(running, workdir / f"routing-{round_}", MODEL,
                                  worker_args=["--engine-options", options],
                                  extra_env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                             "FLATFARE_PREFIX_ROUTING": "true" if prefix_routing else "false"})
            try:
                stack.start_storage()
                stack.start_worker()
                second = _second_worker(stack, options)
                stack.start_gateway(ready_timeout_s=900)
                _wait_two_warm(stack)
                # Fresh documents per run: no run profits from another's cache.
                docs = _documents(args.documents, args.document_words, seed=1000 + round_)
                ttfts, seconds, count = asyncio.run(_routing_run(
                    f"{stack.base_url}/v1/chat/completions", stack.key, docs, args.questions,
                    args.routing_concurrency, args.max_tokens, seed=round_))
                p50, p99 = _pcts(ttfts)
                rows.append([mode, round_ + 1, count, len(ttfts), p50, p99, count / seconds])
                running.stop(second)
            finally:
                stack.stop()
    return rows


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


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.documents, args.questions = 10.0, 4, 3
    info = report.machine()
    sections: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="ff-bench-sched-") as tmp:
        workdir = Path(tmp)
        if "lanes" in args.parts:
            rows = lanes(args, workdir)
            columns = ["mode", "clients' lane", "clients", "requests", "TTFT p50 ms", "TTFT p99 ms"]
            report.write_csv(args.out / "scheduling_lanes.csv", columns, rows)
            sections.append(("Premium and standard under 2x overload", report.markdown_table(columns, rows)))
            _plot_lanes(args.out / "scheduling_lanes.png", rows)
        if "routing" in args.parts:
            rows = routing(args, workdir)
            columns = ["mode", "run", "requests", "answered", "TTFT p50 ms", "TTFT p99 ms", "req/s"]
            report.write_csv(args.out / "scheduling_routing.csv", columns, rows)
            sections.append(("Prefix-aware routing against plain sharing (2 workers)",
                             report.markdown_table(columns, rows)))
            _plot_routing(args.out / "scheduling_routing.png", rows)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    report.write_markdown(args.out / "scheduling.md", "Scheduling: lanes under overload, prefix-aware routing",
                          __doc__ or "", info, settings, sections)
    print((args.out / "scheduling.md").read_text())
    return 0


def _plot_lanes(path: Path, rows: list[list[Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r[0]}\n{r[1]}" for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.bar([i - 0.2 for i in range(len(rows))], [r[4] or 0 for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in range(len(rows))], [r[5] or 0 for r in rows], width=0.4, label="p99")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT by lane at 2x overload (CPU worker)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _plot_routing(path: Path, rows: list[list[Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
