"""The models' tokenizers, as their workers published them (``contract.tokenizer_key``): one loaded
``tokenizers.Tokenizer`` per model, the least recently used dropped past :data:`MAX_TOKENIZERS`.

Only prompts too long for the byte bound reach it (:mod:`flatfare.gateway.openai.prompt_length`), so
its digest read, at most once per ``ttl_s`` a model, is off the common path; a tokenizer is parsed
again only when its digest changes, and parsing and encoding run in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from tokenizers import Tokenizer

from flatfare import contract
from flatfare.redis_conn import REDIS_DOWN

log = logging.getLogger("flatfare.gateway")

MAX_TOKENIZERS = 32
# Long prompts tokenized at once by one gateway process: each takes a thread and a core while it runs.
MAX_CONCURRENT_COUNTS = 2
# Characters encoded per token of the cap before the count is looked at (English averages ~4.5 a token).
CHARS_PER_LIMIT_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Counted:
    """A prompt's tokens; ``complete`` is False where counting stopped once past the limit (at least)."""

    tokens: int
    complete: bool = True


@dataclass(slots=True)
class _Loaded:
    digest: str
    tokenizer: Tokenizer | None  # None: the published one could not be parsed
    checked: float


class Tokenizers:
    def __init__(self, redis: aioredis.Redis, ttl_s: float, maxsize: int = MAX_TOKENIZERS) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._maxsize = maxsize
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._loading: dict[str, asyncio.Future[Tokenizer | None]] = {}
        self._counting = asyncio.Semaphore(MAX_CONCURRENT_COUNTS)

    async def count(self, model: str, texts: Sequence[str], limit: int) -> Counted | None:
        """The tokens of ``texts`` (no special tokens: the caller adds those), counted until they pass
        ``limit``; None when ``model`` has no tokenizer published."""
        tokenizer = await self.get(model)
        if tokenizer is None:
            return None
        async with self._counting:
            return await asyncio.to_thread(_count, tokenizer, list(texts), limit)

    async def get(self, model: str) -> Tokenizer | None:
        known = self._loaded.get(model)
        if known is not None and time.monotonic() - known.checked < self._ttl_s:
            self._loaded.move_to_end(model)
            return known.tokenizer
        loading = self._loading.get(model)
        if loading is None:  # one read per model at a time, however many requests wait for it
            loading = self._loading[model] = asyncio.ensure_future(self._refresh(model))
            loading.add_done_callback(lambda _: self._loading.pop(model, None))
        return await asyncio.shield(loading)

    async def _refresh(self, model: str) -> Tokenizer | None:
        key = contract.tokenizer_key(model)
        known = self._loaded.get(model)
        try:
            digest = await self._redis.hget(key, contract.TOKENIZER_DIGEST)
            if digest is None:
                self._loaded.pop(model, None)
                return None
            if known is not None and known.digest == digest.decode():
                known.checked = time.monotonic()
                return known.tokenizer
            text = await self._redis.hget(key, contract.TOKENIZER_JSON)
        except REDIS_DOWN:  # counted as before Redis went; admission will say whether it is back
            return known.tokenizer if known is not None else None
        if text is None:  # deleted between the two reads
            return None
        try:
            tokenizer: Tokenizer | None = await asyncio.to_thread(Tokenizer.from_str, text.decode())
        except Exception as exc:  # tokenizers raises plain Exception for a file it cannot parse
            log.warning("the tokenizer published for %s cannot be loaded (%s); its prompts are estimated", model, exc)
            tokenizer = None
        self._loaded[model] = _Loaded(digest.decode(), tokenizer, time.monotonic())
        self._loaded.move_to_end(model)
        while len(self._loaded) > self._maxsize:
            self._loaded.popitem(last=False)
        return tokenizer


def _count(tokenizer: Tokenizer, texts: list[str], limit: int) -> Counted:
    """Encode ``texts`` :data:`CHARS_PER_LIMIT_TOKEN` x ``limit`` characters at a time, stopping once
    the count passes ``limit``. A refusal is free, so its cost must not grow with the body: 8 MB of
    English took 3.8 s to encode here; against a 32768-token cap, counting stops after its first
    pieces of 128 K characters. A text cut between pieces may count a token more or less at each cut."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: twice as fast
    pieces = _pieces(texts, (limit + 1) * CHARS_PER_LIMIT_TOKEN)
    tokens = 0
    batch = next(pieces, None)
    while batch is not None:
        tokens += sum(len(encoding.ids) for encoding in encode(batch, add_special_tokens=False))
        batch = next(pieces, None)
        if tokens > limit and batch is not None:
            return Counted(tokens, complete=False)
    return Counted(tokens, complete=True)


def _pieces(texts: list[str], size: int) -> Iterator[list[str]]:
    """``texts`` in batches of at most ``size`` characters, a longer text cut across batches."""
    batch: list[str] = []
    room = size
    for text in texts:
        start = 0
        while start < len(text):
            part = text[start:start + room]
            start += len(part)
            batch.append(part)
            room -= len(part)
            if not room:
                yield batch
                batch, room = [], size
    if batch:
        yield batch
