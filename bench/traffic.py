"""Client groups for the scheduling benchmark: who sends what, and what each request got back.

A :class:`Group` is one kind of customer with accounts of its own (one API key each): open-loop
(Poisson arrivals at a rate, whatever the answers: customers who do not wait for each other) or
closed-loop (N clients, each sending its next request when the last one ended, and waiting the
``Retry-After`` a refusal names, as OpenAI's SDK does). Every request is a streaming chat
completion, and its :class:`Outcome` keeps the HTTP status, the error code, ``Retry-After``, the
time to the first chunk and the time to a refusal.

Arrivals and prompts come from a seed per group and account, so the same group sent twice (alone,
then beside a flood) sends the same requests at the same moments: "the same clients".

Background groups (``measured=False``) start first, run while the measured ones send, and are cut
off once the measured ones have all been answered (their open requests are closed, which cancels
their jobs), so the platform is quiet again before the next run.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

CUT_OFF = -1  # an Outcome's status: a background request still open when its group was stopped
NO_CONNECTION = 0  # the request got no HTTP answer at all


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    keys: tuple[str, ...]  # one per account
    rate: float = 0.0  # open loop: requests per second, all its accounts together
    clients: int = 0  # closed loop: clients at once, spread over its accounts
    measured: bool = True

    def __post_init__(self) -> None:
        if (self.rate > 0) == (self.clients > 0):
            raise ValueError(f"group {self.name}: give a rate (open loop) or clients (closed loop), not both")


@dataclass(frozen=True, slots=True)
class Outcome:
    group: str
    account: int  # the index of its key in the group
    sent_s: float  # since the measured window began (negative: sent while the background settled)
    status: int
    total_s: float  # to the end of the answer, or to the refusal
    ttft_s: float | None = None
    code: str = ""
    retry_after: str | None = None
    queue_ms: float | None = None  # x-flatfare-queue-ms: the gateway's receipt to a worker starting the job

    @property
    def refused(self) -> bool:
        return self.status == 429


@dataclass(frozen=True, slots=True)
class Request:
    url: str
    model: str
    max_tokens: int

    def body(self, prompt: str) -> bytes:
        return orjson.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                             "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True, "temperature": 0})


def _error_code(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsed"


async def send(session: aiohttp.ClientSession, request: Request, key: str, prompt: str, group: str, account: int,
               t0: float) -> Outcome:
    """One streaming chat request; its outcome, timed from just before it was sent."""
    started = time.perf_counter()
    sent_s = started - t0
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        async with session.post(request.url, data=request.body(prompt), headers=headers) as response:
            if response.status != 200:
                raw = await response.read()
                return Outcome(group, account, sent_s, response.status, time.perf_counter() - started,
                               code=_error_code(raw), retry_after=response.headers.get("Retry-After"))
            first: float | None = None
            code = ""
            queue = response.headers.get("x-flatfare-queue-ms")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                if first is None:
                    first = time.perf_counter() - started
                if b'"error":' in line:  # failed mid-stream (worker_lost, timeout)
                    code = _error_code(line[6:])
            return Outcome(group, account, sent_s, 200, time.perf_counter() - started, first, code,
                           queue_ms=float(queue) if queue and queue.isdigit() else None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(group, account, sent_s, NO_CONNECTION, time.perf_counter() - started, code=type(exc).__name__)


class _Sender:
    """The requests of one run: every request task, and the outcomes they ended with."""

    def __init__(self, session: aiohttp.ClientSession, request: Request, t0: float) -> None:
        self.session, self.request, self.t0 = session, request, t0
        self.outcomes: list[Outcome] = []
        self.open: dict[str, set[asyncio.Task[None]]] = {}

    def spawn(self, group: str, coro: Coroutine[Any, Any, None]) -> None:
        tasks = self.open.setdefault(group, set())
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def one(self, group: Group, account: int, prompt: str) -> Outcome:
        sent = time.perf_counter()
        try:
            outcome = await send(self.session, self.request, group.keys[account], prompt, group.name, account,
                                 self.t0)
        except asyncio.CancelledError:
            self.outcomes.append(Outcome(group.name, account, sent - self.t0, CUT_OFF, time.perf_counter() - sent))
            raise
        self.outcomes.append(outcome)
        return outcome

    async def open_loop(self, group: Group, begin: float, until: float, seed: int) -> None:
        """Poisson arrivals for each account (``group.rate`` shared evenly) from ``begin``, none at or
        after ``until``: the same seed, the same moments relative to ``begin``."""
        async def account_arrivals(account: int) -> None:
            rng = random.Random(f"{seed}:{group.name}:{account}")
            at = begin
            n = 0
            while True:
                at += rng.expovariate(group.rate / len(group.keys))
                if at >= until:
                    return
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                n += 1
                prompt = f"{group.name} account {account}, request {n} ({rng.random():.6f}): tell a story."
                self.spawn(group.name, self._discard(self.one(group, account, prompt)))

        await asyncio.gather(*(account_arrivals(i) for i in range(len(group.keys))))

    async def closed_loop(self, group: Group, until: float) -> None:
        async def client(index: int) -> None:
            account = index % len(group.keys)
            n = 0
            while time.perf_counter() < until:
                n += 1
                outcome = await self.one(group, account, f"{group.name} client {index}, request {n}: tell a story.")
                if outcome.refused:
                    await asyncio.sleep(_seconds(outcome.retry_after, default=1.0))
                elif outcome.status != 200:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(client(i) for i in range(group.clients)))

    def start(self, group: Group, begin: float, until: float, seed: int) -> None:
        loop = self.open_loop(group, begin, until, seed) if group.rate else self.closed_loop(group, until)
        self.spawn(group.name, loop)

    async def drained(self, groups: list[Group], timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while any(self.open.get(g.name) for g in groups) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)

    async def cut_off(self, groups: list[Group]) -> None:
        tasks = [t for g in groups for t in self.open.get(g.name, ())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _discard(coro: Coroutine[Any, Any, Outcome]) -> None:
        await coro


def _seconds(header: str | None, default: float) -> float:
    try:
        return max(0.0, float(header)) if header is not None else default
    except ValueError:
        return default


async def _loop_lag(samples: list[float], stop: asyncio.Event) -> None:
    """How late a 10 ms sleep wakes up: the client's own delay, part of every time it measures."""
    while not stop.is_set():
        asked = time.perf_counter()
        await asyncio.sleep(0.01)
        samples.append(time.perf_counter() - asked - 0.01)


@dataclass
class RunResult:
    outcomes: list[Outcome]
    duration_s: float
    loop_lag_s: list[float]

    def of(self, group: str) -> list[Outcome]:
        """The group's requests sent inside the measured window."""
        return [o for o in self.outcomes if o.group == group and 0.0 <= o.sent_s <= self.duration_s]


async def run_groups(request: Request, groups: list[Group], duration_s: float, settle_s: float, seed: int,
                     answer_timeout_s: float = 300.0) -> RunResult:
    """The background groups for ``settle_s``, then everyone for ``duration_s``; returns once every
    measured request has been answered (or ``answer_timeout_s`` passed), the background cut off."""
    measured = [g for g in groups if g.measured]
    background = [g for g in groups if not g.measured]
    lag: list[float] = []
    stop_lag = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=answer_timeout_s)) as s:
        sender = _Sender(s, request, time.perf_counter() + (settle_s if background else 0.0))
        lag_task = asyncio.create_task(_loop_lag(lag, stop_lag))
        now = time.perf_counter()
        for group in background:  # they run until cut off
            sender.start(group, now, now + 24 * 3600, seed)
        await asyncio.sleep(max(0.0, sender.t0 - time.perf_counter()))
        until = sender.t0 + duration_s
        for group in measured:
            sender.start(group, sender.t0, until, seed)
        await asyncio.sleep(duration_s)
        await sender.drained(measured, answer_timeout_s)
        await sender.cut_off(measured + background)
        stop_lag.set()
        await lag_task
    return RunResult(sender.outcomes, duration_s, lag)


def run(request: Request, groups: list[Group], duration_s: float, settle_s: float, seed: int) -> RunResult:
    try:
        import uvloop  # type: ignore[import-not-found]

        return uvloop.run(run_groups(request, groups, duration_s, settle_s, seed))
    except ImportError:
        return asyncio.run(run_groups(request, groups, duration_s, settle_s, seed))


# -- summaries -------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


@dataclass(frozen=True, slots=True)
class GroupSummary:
    sent: int
    answered: int  # 200 with a first chunk and no error
    refused: int  # 429
    cut_off: int  # background requests still open when the run ended
    other_errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    queue_p50_ms: float | None
    queue_p99_ms: float | None
    refusal_p50_ms: float | None
    refusal_p99_ms: float | None
    refusals_with_retry_after: int
    codes: dict[str, int]

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> GroupSummary:
        answered = [o for o in outcomes if o.status == 200 and o.ttft_s is not None and not o.code]
        refused = [o for o in outcomes if o.refused]
        cut_off = sum(1 for o in outcomes if o.status == CUT_OFF)
        codes: dict[str, int] = {}
        for o in outcomes:
            if o.code:
                codes[o.code] = codes.get(o.code, 0) + 1
        ttfts = [o.ttft_s for o in answered if o.ttft_s is not None]
        queues = [o.queue_ms for o in answered if o.queue_ms is not None]
        refusal_times = [o.total_s for o in refused]
        return cls(len(outcomes), len(answered), len(refused), cut_off,
                   len(outcomes) - len(answered) - len(refused) - cut_off,
                   ms(percentile(ttfts, 50)), ms(percentile(ttfts, 99)), percentile(queues, 50), percentile(queues, 99),
                   ms(percentile(refusal_times, 50)),
                   ms(percentile(refusal_times, 99)), sum(1 for o in refused if o.retry_after), codes)
