"""The rehearsal's clients: every request of the schedule sent at its moment, streamed as real clients do
(chat completions, ``stream_options.include_usage``), each account with its own key, no retries.

One aiohttp session sends them all (about 0.1 ms of CPU a request; the OpenAI SDK's httpx costs ten
times that, which at a few hundred streams would time the client, not the platform). The same bytes go
to Flatfare and to ``vllm serve``; to the latter without a key and with the request's engine priority
(premium 0, standard 10: what Flatfare's worker sets), so ``vllm serve --scheduling-policy priority``
gets every advantage the engine alone can give.

Each request's :class:`Record` keeps what a customer saw: the HTTP status and error code, the time to
its first token (TTFT), to a refusal, to its end, and the gaps between its chunks (time per output
token, TPOT, is the mean gap after the first token). **Lost** is a request with no answer at all: no
HTTP status, or a 200 stream that ended without ``[DONE]`` and without an error event.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.rehearsal.schedule import Send

PRIORITY = {"premium": 0, "standard": 10}


@dataclass(slots=True)
class Record:
    index: int
    rank: int
    plan: str
    model: str
    scheduled_s: float  # the schedule's moment, since the replay's start
    sent_s: float = 0.0  # when it went out (late by the client's own delay)
    status: int = 0  # 0: no HTTP answer
    code: str = ""
    retry_after: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0  # to the end of the answer, or of the refusal
    chunks: int = 0
    tpot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    queue_ms: float | None = None  # x-flatfare-queue-ms
    model_wait_ms: float | None = None  # x-flatfare-model-wait-ms: waited for its model's engine
    lost: bool = False
    gaps: list[float] = field(default_factory=list)  # between chunks after the first; not saved

    @property
    def answered(self) -> bool:
        return self.status == 200 and not self.code and not self.lost and self.ttft_s is not None

    def saved(self) -> dict[str, Any]:
        out = asdict(self)
        del out["gaps"]
        out["itl_p99_s"] = _quantile(self.gaps, 0.99)
        return out


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Words:
    """Prompts of a given length in tokens: words that are one token each in the model's tokenizer, drawn
    at random (no two prompts share a prefix, so the prefix cache gives nobody a free prefill)."""

    OVERHEAD = 12  # the chat template's own tokens around one user message, roughly

    def __init__(self, words: Sequence[str]) -> None:
        self.words = list(words)

    @classmethod
    def from_tokenizer(cls, tokenizer_json: str) -> Words:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_json)
        candidates = sorted({piece[1:] for piece in tokenizer.get_vocab() if piece.startswith("Ġ")
                             and piece[1:].isascii() and piece[1:].isalpha() and 3 <= len(piece) - 1 <= 8})
        words = [w for w in candidates if len(tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1]
        if len(words) < 100:
            raise RuntimeError(f"{tokenizer_json}: too few one-token words ({len(words)})")
        return cls(words)

    def prompt(self, tokens: int, rng: random.Random) -> str:
        return " ".join(rng.choices(self.words, k=max(1, tokens - self.OVERHEAD)))


@dataclass
class Target:
    """Where the requests go: Flatfare (a key per account) or ``vllm serve`` (no key, engine priority)."""

    url: str  # .../v1/chat/completions
    keys: dict[int, str] = field(default_factory=dict)  # account rank -> key; empty: vllm serve
    models: dict[str, str] = field(default_factory=dict)  # "main"/"second" -> served model name

    def headers(self, rank: int) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.keys:
            headers["Authorization"] = f"Bearer {self.keys[rank]}"
        return headers


def body(target: Target, model: str, prompt: str, max_tokens: int, lane: str) -> bytes:
    payload: dict[str, Any] = {"model": target.models[model], "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": True}
    if not target.keys:
        payload["priority"] = PRIORITY[lane]
    return orjson.dumps(payload)


async def send(session: aiohttp.ClientSession, target: Target, record: Record, payload: bytes, t0: float) -> None:
    started = time.perf_counter()
    record.sent_s = started - t0
    last = None
    done = False
    try:
        async with session.post(target.url, data=payload, headers=target.headers(record.rank)) as response:
            record.status = response.status
            if response.status != 200:
                raw = await response.read()
                record.code = _error_code(raw)
                record.retry_after = response.headers.get("Retry-After")
                record.total_s = time.perf_counter() - started
                return
            queue = response.headers.get("x-flatfare-queue-ms")
            wait = response.headers.get("x-flatfare-model-wait-ms")
            record.queue_ms = float(queue) if queue else None
            record.model_wait_ms = float(wait) if wait else None
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                    continue
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if line.startswith(b'data: {"error"'):  # failed mid-stream, cleanly (worker_lost, a timeout)
                    record.code = _error_code(line[6:])
                    continue
                if b'"choices":[]' in line:  # the usage chunk
                    usage = orjson.loads(line[6:]).get("usage") or {}
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.completion_tokens = int(usage.get("completion_tokens") or 0)
                    continue
                if record.ttft_s is None:
                    record.ttft_s = now - started
                elif last is not None:
                    record.gaps.append(now - last)
                last = now
                record.chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # no answer, or a stream cut off
        record.code = record.code or type(exc).__name__
        record.lost = True
    record.total_s = time.perf_counter() - started
    if record.status == 200 and not done and not record.code:
        record.lost = True
    if record.gaps:
        record.tpot_s = statistics.fmean(record.gaps)


def _error_code(raw: bytes) -> str:
    try:
        error = orjson.loads(raw)["error"]
        return str(error.get("code") or error.get("type") or "error")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unparsed"


async def replay(target: Target, sends: Sequence[Send], plans: dict[int, str], lanes: dict[int, str],
                 models: dict[int, str], words: Words, max_tokens: Callable[[Send], int], *,
                 prompt_tokens: Callable[[Send], int] = lambda s: s.prompt_tokens, seed: int = 0,
                 timeout_s: float = 900.0,
                 on_start: Callable[[float], None] | None = None) -> tuple[list[Record], float]:
    """Send ``sends`` at their moments; returns every request's record once all have ended, and the
    client's own lateness (p99 seconds behind the schedule)."""
    records = [Record(s.index, s.rank, plans[s.rank], models[s.rank], s.at_s, max_tokens=max_tokens(s))
               for s in sends]
    rng = random.Random(seed)
    payloads = [body(target, models[s.rank], words.prompt(prompt_tokens(s), rng), r.max_tokens, lanes[s.rank])
                for s, r in zip(sends, records, strict=True)]
    late: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        if on_start is not None:
            on_start(t0)
        tasks = []
        for s, record, payload in zip(sends, records, payloads, strict=True):
            delay = t0 + s.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(max(0.0, time.perf_counter() - t0 - s.at_s))
            tasks.append(asyncio.create_task(send(session, target, record, payload, t0)))
        await asyncio.gather(*tasks)
    return records, (_quantile(late, 0.99) or 0.0)
