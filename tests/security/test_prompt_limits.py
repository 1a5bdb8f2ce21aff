"""One request is one price, so its input is bounded too: on every seeded plan, a prompt list of 500 and
a prompt over the plan's max_prompt_tokens are refused before anything is counted, however the text is
spread over the request. The plans come from a migrated database; long text is counted with the real
tokenizer (the default model's, else a byte-level BPE trained here) as the worker publishes it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session
from tokenizers import Tokenizer

from flatfare.billing.plans import AccountTerms, PlanRules
from flatfare.contract import Endpoint
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.checks import check_caps
from flatfare.gateway.openai.kinds import parse_body
from flatfare.gateway.openai.prompt_length import TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT, check_prompt_length
from flatfare.gateway.jobpath.tokenizer_cache import Tokenizers
from flatfare.storage.db import migrate
from flatfare.storage.models import Plan
from flatfare.workers.tokenizer import publish_tokenizer
from tests.gateway.jobpath.test_tokenizer_cache import tokenizer_text  # noqa: F401 (a fixture)
from tests.security.timing import fast, fast_async

MODEL = "smollm2-135m-instruct"  # the free plan allows only the default model
SEEDED = {"free": 4096, "pro": 32768, "premium": 131072, "trial": 32768, "enterprise": None}


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlanRules]:
    url = f"sqlite:///{tmp_path_factory.mktemp('plans') / 'flatfare.db'}"
    migrate(url)
    engine = create_engine(url)
    with Session(engine) as session:
        rules = {row.name: PlanRules.from_row(row) for row in session.scalars(select(Plan))}
    engine.dispose()
    return rules


@pytest.fixture
async def tokenizers(redis, tokenizer_text: str) -> Tokenizers:  # noqa: F811
    await publish_tokenizer(redis, MODEL, tokenizer_text)
    return Tokenizers(redis, ttl_s=60)


def _parsed(endpoint: Endpoint, body: dict[str, Any]):
    return parse_body(endpoint, json.dumps({"model": MODEL, **body}).encode())[1]


async def _refused(plan: PlanRules, counter: Tokenizers | None, endpoint: Endpoint, body: dict[str, Any]) -> APIError:
    parsed = _parsed(endpoint, body)
    with pytest.raises(APIError) as caught:
        await check_prompt_length(parsed, plan, counter)
    assert (caught.value.status, caught.value.code) == (400, "prompt_too_long")
    return caught.value


def test_the_seeded_caps(plans: dict[str, PlanRules]) -> None:
    assert {name: plans[name].max_prompt_tokens for name in SEEDED} == SEEDED


@pytest.mark.parametrize("name", sorted(SEEDED))
@pytest.mark.parametrize("prompt", [["hi"] * 500, [[1, 2, 3]] * 500], ids=["texts", "token-ids"])
def test_a_prompt_list_of_500_is_refused_on_every_plan(plans: dict[str, PlanRules], name: str,
                                                       prompt: list[Any]) -> None:
    raw = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    parsed = parse_body(Endpoint.COMPLETION, raw)[1]

    def attempt() -> APIError:
        with pytest.raises(APIError) as caught:
            check_caps(parsed, AccountTerms(plans[name], plans[name].daily_limit), len(raw))
        return caught.value

    refused = fast(attempt)
    assert (refused.status, refused.param, refused.code) == (400, "prompt", "too_many_sequences")


@pytest.mark.parametrize("name", sorted(SEEDED))
async def test_token_ids_one_past_the_cap_are_refused_at_once(plans: dict[str, PlanRules], name: str) -> None:
    plan = plans[name]
    cap = plan.max_prompt_tokens
    if cap is None:  # enterprise: only the model's context bounds it
        await check_prompt_length(_parsed(Endpoint.COMPLETION, {"prompt": [7] * 200_000}), plan, None)
        return
    exact = _parsed(Endpoint.COMPLETION, {"prompt": [7] * (cap - TOKENS_PER_PROMPT)})
    await check_prompt_length(exact, plan, None)
    over = _parsed(Endpoint.COMPLETION, {"prompt": [7] * (cap - TOKENS_PER_PROMPT + 1)})

    async def attempt() -> APIError:
        with pytest.raises(APIError) as caught:
            await check_prompt_length(over, plan, None)
        return caught.value

    refused = await fast_async(attempt)
    assert refused.code == "prompt_too_long" and f"the {name} plan allows at most {cap} input" in refused.message


@pytest.mark.parametrize("name", sorted(set(SEEDED) - {"enterprise"}))
async def test_a_long_text_prompt_is_counted_with_the_models_tokenizer(plans: dict[str, PlanRules], name: str,
                                                                        tokenizers: Tokenizers,
                                                                        tokenizer_text: str) -> None:  # noqa: F811
    cap = plans[name].max_prompt_tokens
    digits = "0123456789" * (cap // 10 + 1)  # one token a digit: a quarter of the bytes would pass it
    tokens = len(Tokenizer.from_str(tokenizer_text).encode(digits, add_special_tokens=False).ids)
    refused = await _refused(plans[name], tokenizers, Endpoint.COMPLETION, {"prompt": digits})
    assert f"prompt is {tokens + TOKENS_PER_PROMPT} tokens" in refused.message


async def test_text_spread_over_parts_messages_and_tool_calls_counts_together(plans: dict[str, PlanRules],
                                                                              tokenizers: Tokenizers) -> None:
    free = plans["free"]
    chunk = "0123456789" * 5  # 50 tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": chunk}] * 90}]
    await _refused(free, tokenizers, Endpoint.CHAT, {"messages": parts})  # 4500 tokens in one message
    messages = [{"role": "user", "content": chunk}] * 80  # 4000 + 80 messages' template tokens
    refused = await _refused(free, tokenizers, Endpoint.CHAT, {"messages": messages})
    assert f"is {4000 + 80 * TOKENS_PER_MESSAGE} tokens" in refused.message
    hidden = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "c1", "type": "function", "function": {"name": "f", "arguments": chunk * 90}}]}]
    await _refused(free, tokenizers, Endpoint.CHAT, {"messages": hidden})
    ids = {"prompt": [list(range(100))] * 1}  # within every cap: served
    await check_prompt_length(_parsed(Endpoint.COMPLETION, ids), free, tokenizers)

