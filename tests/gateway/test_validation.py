"""Request validation names the offending parameter the way OpenAI does, without HTTP or Redis."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from flatfare.billing.plans import AccountTerms, PlanRules
from flatfare.contract import Endpoint
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.checks import check_caps
from flatfare.gateway.openai.prompt_length import (TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT, PromptParts,
                                                   check_prompt_length, prompt_parts)
from flatfare.gateway.jobpath.tokenizer_cache import Counted
from flatfare.gateway.openai.kinds import parse_body
from flatfare.storage.models import Lane


def _param(raw: bytes, endpoint: Endpoint = Endpoint.CHAT) -> str | None:
    with pytest.raises(APIError) as caught:
        parse_body(endpoint, raw)
    assert caught.value.status == 400
    return caught.value.param


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}',
         "stream_options.include_usage"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
def test_chat_params(raw: bytes, param: str) -> None:
    assert _param(raw) == param


def test_completion_needs_a_prompt() -> None:
    assert _param(b'{"model": "m"}', Endpoint.COMPLETION) == "prompt"


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b'{"model": ', b"null"])
def test_not_a_json_object(raw: bytes) -> None:
    assert _param(raw) is None


def test_extra_fields_pass_through_to_the_engine() -> None:
    body, parsed = parse_body(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                            b'"ignore_eos": true, "max_tokens": 5}')
    assert body["ignore_eos"] is True and parsed.output_tokens() == 5


def _terms(max_n: int) -> AccountTerms:
    plan = PlanRules(name="pro", daily_limit=1000, price_per_request_micros=0, lane=Lane.STANDARD,
                     allowed_models=None, max_output_tokens=None, max_n=max_n, max_body_bytes=1 << 20, timezone="UTC")
    return AccountTerms(plan=plan, daily_limit=1000)


def _refusal(endpoint: Endpoint, body: dict[str, object], max_n: int = 8) -> APIError:
    raw = json.dumps(body).encode()
    _, parsed = parse_body(endpoint, raw)
    with pytest.raises(APIError) as caught:
        check_caps(parsed, _terms(max_n), len(raw))
    return caught.value


@pytest.mark.parametrize(("prompt", "sequences"), [
    (["hi"] * 500, 500),
    ([[1, 2, 3]] * 64, 64),
    (["a", "b", "c"], 6),  # x n=2
])
def test_a_prompt_list_counts_as_its_prompts_times_n(prompt: list[object], sequences: int) -> None:
    refused = _refusal(Endpoint.COMPLETION, {"model": "m", "prompt": prompt, "n": 2 if len(prompt) == 3 else 1},
                       max_n=5)
    assert (refused.status, refused.param, refused.code) == (400, "prompt", "too_many_sequences")
    assert f"asks for {sequences} generated sequences" in refused.message and "pro plan" in refused.message


def test_best_of_counts_as_the_request_s_work() -> None:
    refused = _refusal(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2,
                                       "best_of": 9})
    assert (refused.param, refused.code) == ("best_of", "too_many_sequences")


@pytest.mark.parametrize(("endpoint", "body"), [
    (Endpoint.COMPLETION, {"model": "m", "prompt": ["a", "b"], "n": 4}),
    (Endpoint.COMPLETION, {"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "n": 8}),  # token ids: one prompt
    (Endpoint.COMPLETION, {"model": "m", "prompt": "one", "n": 8}),
    (Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 8}),
])
def test_work_within_the_cap_passes(endpoint: Endpoint, body: dict[str, object]) -> None:
    raw = json.dumps(body).encode()
    _, parsed = parse_body(endpoint, raw)
    check_caps(parsed, _terms(8), len(raw))


def test_an_empty_prompt_list_is_refused() -> None:
    assert _param(b'{"model": "m", "prompt": []}', Endpoint.COMPLETION) == "prompt"


# -- the plan's input cap (max_prompt_tokens), counted before any unit is --

class _Tokenizer:
    """Records what reaches the tokenizer; counts one token per byte (the byte bound's worst case), or
    answers None: no tokenizer published."""

    def __init__(self, published: bool = True) -> None:
        self.asked: list[tuple[str, ...]] = []
        self.published = published

    async def count(self, model: str, texts: Sequence[str], limit: int) -> Counted | None:
        self.asked.append(tuple(texts))
        return Counted(sum(len(t.encode()) for t in texts)) if self.published else None


def _plan(max_prompt_tokens: int | None, name: str = "free") -> PlanRules:
    return PlanRules(name=name, daily_limit=20, price_per_request_micros=0, lane=Lane.STANDARD, allowed_models=None,
                     max_output_tokens=None, max_n=4, max_body_bytes=1 << 24, timezone="UTC",
                     max_prompt_tokens=max_prompt_tokens)


async def _prompt_check(endpoint: Endpoint, body: dict[str, object], cap: int | None,
                        tokenizer: _Tokenizer | None = None) -> APIError | None:
    _, parsed = parse_body(endpoint, json.dumps({"model": "m", **body}).encode())
    try:
        await check_prompt_length(parsed, _plan(cap), tokenizer)
    except APIError as refused:
        return refused
    return None


def test_the_prompt_is_every_text_part_and_token_id() -> None:
    _, chat = parse_body(Endpoint.CHAT, json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "héllo"},
                                     {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
    ]}).encode())
    parts = prompt_parts(chat)
    assert parts.texts == ("be brief", "héllo") and parts.overhead == 2 * TOKENS_PER_MESSAGE
    assert parts.byte_bound() == 8 + 6 + 2 * TOKENS_PER_MESSAGE  # é is two bytes
    _, ids = parse_body(Endpoint.COMPLETION, b'{"model": "m", "prompt": [[1, 2, 3], [4, 5]]}')
    assert prompt_parts(ids) == PromptParts((), token_ids=5, overhead=2 * TOKENS_PER_PROMPT)
    _, texts = parse_body(Endpoint.COMPLETION, b'{"model": "m", "prompt": ["ab", "cde"]}')
    assert prompt_parts(texts).byte_bound() == 5 + 2 * TOKENS_PER_PROMPT


async def test_a_prompt_within_the_byte_bound_is_never_tokenized() -> None:
    tokenizer = _Tokenizer()
    fits = 4096 - TOKENS_PER_PROMPT
    assert await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * fits}, 4096, tokenizer) is None
    assert tokenizer.asked == []
    # One byte more and the bound no longer proves it: the tokenizer decides (and, one token a byte, refuses).
    refused = await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * (fits + 1)}, 4096, tokenizer)
    assert tokenizer.asked == [("x" * (fits + 1),)]
    assert refused is not None and refused.code == "prompt_too_long"


async def test_the_refusal_names_the_count_the_limit_and_the_plan() -> None:
    # Token ids are counted exactly, with no tokenizer at all.
    refused = await _prompt_check(Endpoint.COMPLETION, {"prompt": [7] * 5121}, 4096)
    assert (refused.status, refused.param, refused.code) == (400, "prompt", "prompt_too_long")
    assert refused.message.startswith(f"This request's prompt is {5121 + TOKENS_PER_PROMPT} tokens; the free plan "
                                      "allows at most 4096 input tokens per request.")
    chat = await _prompt_check(Endpoint.CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, 4096,
                               _Tokenizer())
    assert (chat.param, chat.code) == ("messages", "prompt_too_long")
    assert f"is {5000 + TOKENS_PER_MESSAGE} tokens" in chat.message


async def test_every_prompt_of_a_list_counts_toward_one_requests_cap() -> None:
    refused = await _prompt_check(Endpoint.COMPLETION, {"prompt": ["x" * 1500] * 3}, 4096, _Tokenizer())
    assert refused is not None and f"is {4500 + 3 * TOKENS_PER_PROMPT} tokens" in refused.message


async def test_without_a_tokenizer_a_quarter_of_the_bytes_is_the_count() -> None:
    cold = _Tokenizer(published=False)
    # 16_000 bytes: ~4000 tokens by the estimate, under the cap; the byte count alone would have refused it.
    assert await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * 16_000}, 4096, cold) is None
    refused = await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * 20_001}, 4096, cold)
    assert refused is not None and f"is {5001 + TOKENS_PER_PROMPT} tokens" in refused.message
    assert await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * 20_001}, 4096, None) is not None


async def test_a_plan_without_a_cap_counts_nothing() -> None:
    tokenizer = _Tokenizer()
    assert await _prompt_check(Endpoint.COMPLETION, {"prompt": "x" * 100_000}, None, tokenizer) is None
    assert tokenizer.asked == []
