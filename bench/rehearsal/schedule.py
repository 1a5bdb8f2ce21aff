"""What the rehearsal sends, and when: a window of the Azure trace, sampled and time-compressed, its
requests spread over accounts on mixed plans by a stated rule. Pure: no IO but reading the trace.

**The trace** (bench/traces/, CC-BY 4.0): arrival times, prompt and output lengths of one hour of a
conversation service. A window of it (trace minutes ``[start, end)``) is replayed ``compression``
times faster, each request kept with probability ``sample`` (a seeded draw), so that the GPU is
loaded past its capacity in the trace's busy minutes without the replay outlasting a device call;
thinning keeps the minute-to-minute shape of the load (busy and quiet minutes stay where they are).

**The accounts** (:func:`accounts`), ``count`` of them, ranked by how much they send: each live
request's account is a Zipf draw (exponent ``zipf``) over the ranks, so rank 1 sends the most. The
plan rule, in rank order:

- ranks 1 and 3 are on Free, 2 and 4 on Pro: the heaviest accounts, on the plans whose daily quota
  and in-flight cap bound them (``heavy``; a second run leaves them out);
- ranks 6, 9, 12, 15, 18, 21 and 24 are on Premium (the priority lane), rank 8 on Enterprise (the
  priority lane, no daily limit; on the shared pool: one GPU holds no dedicated pool beside two models);
- every 25th rank from 40 (40, 65, ...) sends to the second model, which therefore idles, sleeps and
  wakes during the run; those accounts are on Pro;
- ranks 25 and up ending in 5 are on the 7-day Trial;
- the rest: Pro where the rank is a multiple of 3, else Free.

**Batch lines**: each sampled request is a Batch API line instead of a live request with probability
``batch_share``; lines go to the batch accounts (ranks 11, 13 and 17, on Pro), a file each.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "traces" / "azure_llm_2023_conv.csv.gz"

HEAVY = {1: "free", 2: "pro", 3: "free", 4: "pro"}
PREMIUM = (6, 9, 12, 15, 18, 21, 24)
ENTERPRISE = 8
BATCH_ACCOUNTS = (11, 13, 17)
SECOND_MODEL_FROM, SECOND_MODEL_EVERY = 40, 25
MAIN, SECOND = "main", "second"

# The seeded plans' limits (migrations 0001, 0004, 0005): what the load estimate assumes unless the platform's
# own plans table is passed in (bench/rehearsal/platform.py reads it).
SEEDED = {
    "free": {"daily_limit": 60, "max_prompt_tokens": 4096, "max_output_tokens": 512},
    "pro": {"daily_limit": 1000, "max_prompt_tokens": 32768, "max_output_tokens": 4096},
    "trial": {"daily_limit": 1000, "max_prompt_tokens": 32768, "max_output_tokens": 4096},
    "premium": {"daily_limit": 5000, "max_prompt_tokens": 131072, "max_output_tokens": 8192},
    "enterprise": {"daily_limit": None, "max_prompt_tokens": None, "max_output_tokens": None},
}
LANE = {"premium": "premium", "enterprise": "premium"}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float  # since the trace's first request
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Account:
    rank: int
    plan: str
    model: str = MAIN
    heavy: bool = False

    @property
    def lane(self) -> str:
        return LANE.get(self.plan, "standard")


@dataclass(frozen=True, slots=True)
class Send:
    """One request of the replay."""

    index: int
    at_s: float  # seconds after the replay's start
    minute: int  # the trace minute it comes from
    rank: int  # its account
    prompt_tokens: int
    output_tokens: int  # what the trace generated: max_tokens, forced with ignore_eos (clamped to the plan)
    batch: bool = False


@dataclass(frozen=True, slots=True)
class Window:
    start_min: float
    end_min: float
    sample: float  # fraction of the trace's requests kept
    compression: float  # replay seconds = trace seconds / compression
    seed: int = 32

    @property
    def duration_s(self) -> float:
        return (self.end_min - self.start_min) * 60 / self.compression


def load(path: Path = TRACE) -> list[TraceRequest]:
    raw = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    rows = list(csv.DictReader(io.StringIO(raw)))
    first = _timestamp(rows[0]["TIMESTAMP"])
    return [TraceRequest((_timestamp(r["TIMESTAMP"]) - first).total_seconds(), int(r["ContextTokens"]),
                         int(r["GeneratedTokens"])) for r in rows]


def _timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text[:26])  # microseconds: the trace has 7 digits


def plan_of(rank: int) -> str:
    if rank in HEAVY:
        return HEAVY[rank]
    if rank in PREMIUM:
        return "premium"
    if rank == ENTERPRISE:
        return "enterprise"
    if rank in BATCH_ACCOUNTS or _second(rank):
        return "pro"
    if rank >= 25 and rank % 10 == 5:
        return "trial"
    return "pro" if rank % 3 == 0 else "free"


def _second(rank: int) -> bool:
    return rank >= SECOND_MODEL_FROM and (rank - SECOND_MODEL_FROM) % SECOND_MODEL_EVERY == 0


def accounts(count: int) -> dict[int, Account]:
    return {rank: Account(rank, plan_of(rank), SECOND if _second(rank) else MAIN, rank in HEAVY)
            for rank in range(1, count + 1)}


class Zipf:
    def __init__(self, count: int, exponent: float) -> None:
        weights = [1.0 / rank ** exponent for rank in range(1, count + 1)]
        total = sum(weights)
        running = 0.0
        self.cumulative = []
        for weight in weights:
            running += weight / total
            self.cumulative.append(running)

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cumulative, rng.random()), len(self.cumulative) - 1) + 1


def build(trace: Sequence[TraceRequest], window: Window, count: int = 300, zipf: float = 1.0,
          batch_share: float = 0.08) -> list[Send]:
    """The replay's requests, in order. One seeded draw sequence whatever is left out later, so every run
    of the same window sends the same requests at the same moments to the same accounts."""
    rng = random.Random(window.seed)
    ranks = Zipf(count, zipf)
    begin, end = window.start_min * 60, window.end_min * 60
    sends: list[Send] = []
    for request in trace:
        if not begin <= request.at_s < end:
            continue
        keep, batch, pick = rng.random(), rng.random(), ranks.draw(rng)
        if keep >= window.sample:
            continue
        is_batch = batch < batch_share
        rank = BATCH_ACCOUNTS[pick % len(BATCH_ACCOUNTS)] if is_batch else pick
        sends.append(Send(len(sends), (request.at_s - begin) / window.compression, int(request.at_s // 60), rank,
                          request.prompt_tokens, request.output_tokens, is_batch))
    return sends


def engine_load(sends: Iterable[Send], book: dict[int, Account],
                plans: dict[str, dict[str, int | None]] | None = None) -> list[Send]:
    """The live requests of the main model that the plans' rules let through to the engine: each account's
    daily quota (in order) and prompt cap; what a platform without plans would also run, and more."""
    plans = plans or SEEDED
    used: Counter[int] = Counter()
    kept = []
    for send in sends:
        account = book[send.rank]
        if send.batch or account.model != MAIN:
            continue
        limit, prompt_cap = plans[account.plan]["daily_limit"], plans[account.plan]["max_prompt_tokens"]
        if prompt_cap is not None and send.prompt_tokens > prompt_cap:
            continue
        used[send.rank] += 1
        if limit is not None and used[send.rank] > limit:
            continue
        kept.append(send)
    return kept


def per_minute(sends: Iterable[Send], window: Window) -> dict[int, float]:
    """Requests a second of replay, per trace minute of the window."""
    seconds = 60 / window.compression
    counts = Counter(send.minute for send in sends)
    first, last = int(window.start_min), int(window.end_min - 1e-9)
    return {minute: counts.get(minute, 0) / seconds for minute in range(first, last + 1)}


def classify(rates: dict[int, float], share: float = 0.25) -> dict[int, str]:
    """Each trace minute as ``busy`` (the ``share`` with the most load), ``quiet`` (the share with the
    least) or ``middle``."""
    ordered = sorted(rates, key=lambda m: (rates[m], m))
    n = max(1, round(len(ordered) * share))
    kinds = {minute: "middle" for minute in ordered}
    for minute in ordered[:n]:
        kinds[minute] = "quiet"
    for minute in ordered[-n:]:
        kinds[minute] = "busy"
    return kinds


def sample_for(trace: Sequence[TraceRequest], window: Window, capacity_rps: float, peak_load: float,
               count: int = 300, zipf: float = 1.0, batch_share: float = 0.08,
               plans: dict[str, dict[str, int | None]] | None = None) -> float:
    """The sample that loads the window's busiest minute to ``peak_load`` x ``capacity_rps`` (requests
    a second the engine completes), counting only what the plans let through (quotas bind less as the
    sample grows, so a few rounds of proportion); at most 1."""
    book = accounts(count)
    sample = 1.0
    for _ in range(4):
        trial = Window(window.start_min, window.end_min, sample, window.compression, window.seed)
        peak = max(per_minute(engine_load(build(trace, trial, count, zipf, batch_share), book, plans), trial).values(),
                   default=0.0)
        if peak <= 0:
            return 1.0
        sample = min(1.0, sample * peak_load * capacity_rps / peak)
    return sample
