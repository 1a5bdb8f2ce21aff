"""Batch work on idle capacity: the live lanes' time to first token with and without a batch running.

One gateway and one worker, a live load of streaming chat requests at a fixed rate (open loop),
measured alone and with a large batch running on the batch lane, alternately (A B A B: these VMs
drift). The batch may fill what the live load leaves idle, and must not raise the live TTFT p99 by
more than 10 %.

``--engine instant`` (bench/results/batch.md): the instant engine with realistic delays (a first token
after 50 ms, then 16 tokens 20 ms apart), so only Flatfare's lanes are measured. ``--engine vllm``
(bench/results/batch_cpu.md): the real vLLM CPU engine serving the default model, where batch lines and
live requests share one engine's compute: a CPU worker runs one batch line at a time and starts none
while a live request runs (a line already running finishes), and batch lines have vLLM's lowest
priority (``--scheduling-policy priority``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import report
from bench.procs import services
from bench.stack import FlatfareStack

INSTANT = "instant"
DELAYS = {"FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "0.05", "FLATFARE_INSTANT_TOKEN_DELAY_S": "0.02",
          "FLATFARE_INSTANT_TOKENS": "16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=20.0, help="live requests a second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each phase measures")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs")
    parser.add_argument("--batch-lines", type=int, default=4000, help="lines of each phase's batch")
    parser.add_argument("--engine", choices=["instant", "vllm"], default="instant",
                        help="the worker's engine: instant (lanes only) or vLLM's CPU engine (the default model)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each live request and batch line")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--workdir", type=Path, help="where the stack's files and logs go (default: a temporary folder)")


async def _live(url: str, key: str, model: str, rate: float, duration_s: float,
                max_tokens: int) -> list[float | None]:
    """Open-loop streaming chat requests; each one's time to its first chunk (None: not answered)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True}

    async def one(session: aiohttp.ClientSession) -> float | None:
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as response:
            first = None
            async for line in response.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - started
            return first if response.status == 200 else None

    async with aiohttp.ClientSession() as session:
        tasks = []
        start = time.perf_counter()
        for n in range(int(rate * duration_s)):
            await asyncio.sleep(max(start + n / rate - time.perf_counter(), 0))
            tasks.append(asyncio.create_task(one(session)))
        return list(await asyncio.gather(*tasks))


async def _start_batch(url: str, key: str, model: str, lines: int, max_tokens: int) -> str:
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": "hi"}]}}) + "\n"
                   for i in range(lines))
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data.encode(), filename="lines.jsonl", content_type="application/jsonl")
        async with session.post(f"{url}/v1/files", data=form, headers=headers) as response:
            file_id = (await response.json())["id"]
        async with session.post(f"{url}/v1/batches", headers=headers, json={
                "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}) as response:
            return (await response.json())["id"]


async def _batch(url: str, key: str, batch_id: str, action: str = "") -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        method, path = ("POST", f"/v1/batches/{batch_id}/cancel") if action else ("GET", f"/v1/batches/{batch_id}")
        async with session.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {key}"}) as response:
            return await response.json()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000


async def _phase(stack: FlatfareStack, args: argparse.Namespace, with_batch: bool) -> list[Any]:
    batch_id = (await _start_batch(stack.base_url, stack.key, stack.model, args.batch_lines, args.max_tokens)
                if with_batch else "")
    if batch_id:  # measure only once it runs
        while (await _batch(stack.base_url, stack.key, batch_id))["request_counts"]["completed"] < 20:
            await asyncio.sleep(0.2)
        before = (await _batch(stack.base_url, stack.key, batch_id))["request_counts"]["completed"]
    ttfts = await _live(stack.base_url, stack.key, stack.model, args.rate, args.duration, args.max_tokens)
    done = 0.0
    if batch_id:
        state = await _batch(stack.base_url, stack.key, batch_id)
        done = (state["request_counts"]["completed"] - before) / args.duration
        assert state["status"] == "in_progress", "the batch ran out during the phase: raise --batch-lines"
        await _batch(stack.base_url, stack.key, batch_id, "cancel")
        while (await _batch(stack.base_url, stack.key, batch_id))["status"] != "cancelled":
            await asyncio.sleep(0.5)
    answered = [t for t in ttfts if t is not None]
    return ["with batch" if with_batch else "alone", len(ttfts), len(answered), _p(answered, 0.5),
            _p(answered, 0.99), round(done, 1)]


def run(args: argparse.Namespace) -> int:
    report.mark_start()
    info = report.machine()
    rows: list[list[Any]] = []
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    folder = contextlib.nullcontext(str(args.workdir)) if args.workdir else \
        tempfile.TemporaryDirectory(prefix="ff-bench-batch-")
    with folder as tmp, services() as group:
        if args.engine == "instant":
            stack = FlatfareStack(group, Path(tmp), INSTANT, worker_args=["--engine", "instant"], extra_env=DELAYS)
        else:
            from bench.engine import DEFAULT_NAME, default_model_dir

            # A KV cache of its own size: vLLM's CPU backend otherwise wants 92 % of the host's memory free.
            stack = FlatfareStack(group, Path(tmp), DEFAULT_NAME, worker_args=["--source", str(default_model_dir())],
                                  extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        stack.start_storage()
        stack.start_worker()
        stack.start_gateway(ready_timeout_s=900)
        try:
            for _ in range(args.rounds):
                for with_batch in (False, True):
                    rows.append(asyncio.run(_phase(stack, args, with_batch)))
                    print(rows[-1], flush=True)
        finally:
            stack.stop()
    alone = statistics.median(r[4] for r in rows if r[0] == "alone")
    loaded = statistics.median(r[4] for r in rows if r[0] == "with batch")
    columns = ["phase", "live requests", "answered", "TTFT p50 ms", "TTFT p99 ms", "batch lines/s"]
    verdict = (f"Live TTFT p99, median of the phases: {alone:.1f} ms alone, {loaded:.1f} ms with a batch running "
               f"({(loaded / alone - 1) * 100:+.1f} %; the bound is +10 %).")
    name = "batch" if args.engine == "instant" else "batch_cpu"
    engine = "instant engine" if args.engine == "instant" else f"vLLM CPU engine, {stack.model}"
    report.write_csv(args.out / f"{name}.csv", columns, rows)
    report.write_markdown(args.out / f"{name}.md", f"Batch lines on idle capacity ({engine}): live TTFT with and without a batch",
                          __doc__ or "", info, {k: str(v) for k, v in vars(args).items() if k != "out"},
                          [("Phases (alternating)", report.markdown_table(columns, rows)), ("Verdict", verdict)])
    print(verdict)
    return 0
