"""The plan's input cap through the live stack (real worker, real SmolLM2 tokenizer, the openai SDK): a
free-plan prompt over 4096 tokens is refused before anything is counted; one under it is served."""

from __future__ import annotations

import uuid

import openai
import pytest
from tokenizers import Tokenizer

from flatfare.gateway.openai.prompt_length import TOKENS_PER_MESSAGE
from flatfare.workers.prepare import SMOLLM2
from tests.conftest import MODELS_DIR

pytestmark = pytest.mark.e2e

FREE_CAP = 4096
# Digits are one token each in SmolLM2: 5500 tokens in 5500 bytes. A quarter of the bytes (the estimate
# used before a worker published its tokenizer) is 1375, so only the real count refuses this one.
DIGITS = "0123456789 " * 500
# ~1000 tokens in 4500 bytes: past the byte bound, so it is tokenized, and under the cap (and the stack's
# 2048-token context).
ENGLISH = "The quick brown fox jumps over the lazy dog. " * 100


def _free_client(stack) -> openai.OpenAI:
    created = stack.cli("keys", "create", "--account", f"free-{uuid.uuid4().hex[:8]}", "--plan", "free")
    assert created.returncode == 0, created.stderr
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=created.stdout.strip(), max_retries=0, timeout=300)


def _tokens(text: str) -> int:
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / SMOLLM2 / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _remaining(headers) -> int:
    return int(headers["x-ratelimit-remaining-requests"])


def test_a_free_prompt_over_its_cap_is_refused_before_it_is_counted(stack) -> None:
    client = _free_client(stack)
    first = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    before = _remaining(first.headers)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": DIGITS}], max_tokens=2)
    error = refused.value.body
    assert (error["code"], error["param"]) == ("prompt_too_long", "messages")
    tokens = _tokens(DIGITS) + TOKENS_PER_MESSAGE  # the worker's tokenizer counted it, not an estimate
    assert tokens > FREE_CAP
    assert error["message"].startswith(f"This request's prompt is {tokens} tokens; the free plan allows at most "
                                       f"{FREE_CAP} input tokens per request.")
    assert _remaining(refused.value.response.headers) == before
    under = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=[{"role": "user", "content": ENGLISH}], max_tokens=2)
    assert len(ENGLISH) > FREE_CAP > _tokens(ENGLISH)
    assert under.parse().usage.prompt_tokens < FREE_CAP
    assert _remaining(under.headers) == before - 1  # the refusal took no unit; this one took one


def test_a_completion_prompt_list_counts_together(stack) -> None:
    client = _free_client(stack)
    # Token ids are counted exactly: 4097 of them, no tokenizer needed.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=stack.model, prompt=[7] * (FREE_CAP + 1), max_tokens=2)
    assert (refused.value.body["code"], refused.value.body["param"]) == ("prompt_too_long", "prompt")
