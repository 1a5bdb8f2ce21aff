"""Counting a long prompt with the model's own tokenizer: the worker publishes it in Redis, the gateway
loads it once per digest and counts in a thread. Real Redis, real tokenizers: the default model's
tokenizer.json when `flatfare up` prepared it, else a small byte-level BPE trained here."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flatfare import contract
from flatfare.billing.plans import PlanRules
from flatfare.contract import Endpoint
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.kinds import parse_body
from flatfare.gateway.openai.prompt_length import TOKENS_PER_PROMPT, check_prompt_length
from flatfare.gateway.jobpath.tokenizer_cache import CHARS_PER_LIMIT_TOKEN, Counted, Tokenizers
from flatfare.storage.models import Lane
from flatfare.workers.prepare import SMOLLM2
from flatfare.workers.tokenizer import publish_tokenizer, tokenizer_json
from tests.conftest import MODELS_DIR, VISIBLE_WITHIN_S

MODEL = "m"
TTL_S = 0.2
LIMIT = 1 << 20  # counts below it are whole
ENGLISH = "The quick brown fox jumps over the lazy dog. "
# Texts whose tokens per byte differ: digits are one token each in SmolLM2, English ~4.5 bytes a token.
SAMPLES = [ENGLISH * 50, "0123456789 " * 300, "日本語のテキストです。" * 100, "🙂🚀" * 200, " " * 3000,
           "a" * 5000, "\n\t  x = [1, 2, 3]\n" * 200, "ﷺ" * 100]


def _trained(corpus: list[str], vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def tokenizer_text() -> str:
    folder = MODELS_DIR / SMOLLM2
    if (folder / "tokenizer.json").is_file():
        return tokenizer_json(str(folder))
    return _trained([ENGLISH * 20], 400)  # digits stay one token a byte, as in SmolLM2


def _count(text: str, tokenizer_text: str) -> int:
    return len(Tokenizer.from_str(tokenizer_text).encode(text, add_special_tokens=False).ids)


def _free(cap: int = 4096) -> PlanRules:
    return PlanRules(name="free", daily_limit=20, price_per_request_micros=0, lane=Lane.STANDARD, allowed_models=None,
                     max_output_tokens=None, max_n=1, max_body_bytes=1 << 24, timezone="UTC", max_prompt_tokens=cap)


def test_every_token_covers_at_least_one_byte(tokenizer_text: str) -> None:
    """What the gateway's fast path stands on: a text within the cap in bytes is within it in tokens."""
    for text in SAMPLES:
        assert _count(text, tokenizer_text) <= len(text.encode()) + TOKENS_PER_PROMPT, text[:20]


async def test_the_gateway_counts_with_the_tokenizer_the_worker_published(redis, tokenizer_text: str) -> None:
    tokenizers = Tokenizers(redis, TTL_S)
    assert await tokenizers.count(MODEL, ["hello"], LIMIT) is None  # nothing published yet
    assert await publish_tokenizer(redis, MODEL, tokenizer_text)
    assert not await publish_tokenizer(redis, MODEL, tokenizer_text)  # a replica's start rewrites nothing
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while (counted := await tokenizers.count(MODEL, SAMPLES[:2], LIMIT)) is None:
        assert time.monotonic() < deadline, "the published tokenizer was not seen"
        await asyncio.sleep(TTL_S / 2)
    assert counted == Counted(sum(_count(text, tokenizer_text) for text in SAMPLES[:2]), complete=True)


async def test_a_new_tokenizer_replaces_the_loaded_one(redis, tokenizer_text: str) -> None:
    tokenizers = Tokenizers(redis, TTL_S)
    await publish_tokenizer(redis, MODEL, tokenizer_text)
    digits = "0123456789" * 100
    first = await tokenizers.count(MODEL, [digits], LIMIT)
    assert first == Counted(_count(digits, tokenizer_text))
    # A tokenizer that learnt the digits as one token: the digest changes, and the gateway reloads it.
    other = _trained(["0123456789" * 50] * 20, 300)
    assert await publish_tokenizer(redis, MODEL, other)
    assert json.loads(other) != json.loads(tokenizer_text)
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while (counted := await tokenizers.count(MODEL, [digits], LIMIT)) == first:
        assert time.monotonic() < deadline, "the new tokenizer was not loaded"
        await asyncio.sleep(TTL_S / 2)
    assert counted.tokens == _count(digits, other) < first.tokens
    stored = await redis.hget(contract.tokenizer_key(MODEL), contract.TOKENIZER_DIGEST)
    assert stored is not None


async def test_a_long_prompt_is_refused_on_the_real_count(redis, tokenizer_text: str) -> None:
    await publish_tokenizer(redis, MODEL, tokenizer_text)
    tokenizers = Tokenizers(redis, TTL_S)
    digits = "0123456789 " * 500  # 5500 bytes; a quarter of them (the cold estimate) would pass
    tokens = _count(digits, tokenizer_text)
    assert tokens > 4096
    _, parsed = parse_body(Endpoint.COMPLETION, json.dumps({"model": MODEL, "prompt": digits}).encode())
    with pytest.raises(APIError) as refused:
        await check_prompt_length(parsed, _free(), tokenizers)
    assert refused.value.code == "prompt_too_long"
    assert f"prompt is {tokens + TOKENS_PER_PROMPT} tokens" in refused.value.message
    english = ENGLISH * 200  # 9000 bytes, about 2000 tokens: over the byte bound, under the cap
    _, parsed = parse_body(Endpoint.COMPLETION, json.dumps({"model": MODEL, "prompt": english}).encode())
    assert _count(english, tokenizer_text) < 4096 < len(english)
    await check_prompt_length(parsed, _free(), tokenizers)


async def test_an_unreadable_tokenizer_falls_back_to_the_estimate(redis) -> None:
    await redis.hset(contract.tokenizer_key(MODEL), mapping={contract.TOKENIZER_DIGEST: "x",
                                                              contract.TOKENIZER_JSON: "{not json"})
    assert await Tokenizers(redis, TTL_S).count(MODEL, ["hello"], LIMIT) is None


async def test_counting_stops_once_past_the_limit(redis, tokenizer_text: str) -> None:
    """A refusal is free: a megabyte of digits against a 4096-token cap encodes a piece or two, not all."""
    await publish_tokenizer(redis, MODEL, tokenizer_text)
    tokenizers = Tokenizers(redis, TTL_S)
    piece = (4096 + 1) * CHARS_PER_LIMIT_TOKEN
    counted = await tokenizers.count(MODEL, ["0123456789" * 100_000], 4096)
    assert counted is not None and not counted.complete and 4096 < counted.tokens <= piece
    # Texts shorter than a piece, however many, are counted whole and exactly.
    many = [ENGLISH * 3] * 40
    assert await tokenizers.count(MODEL, many, 4096) == Counted(sum(_count(t, tokenizer_text) for t in many))
    _, parsed = parse_body(Endpoint.COMPLETION, json.dumps({"model": MODEL, "prompt": "7" * 1_000_000}).encode())
    with pytest.raises(APIError) as refused:
        await check_prompt_length(parsed, _free(), tokenizers)
    assert refused.value.message.startswith("This request's prompt is at least ")
