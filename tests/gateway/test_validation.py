"""Request validation names the offending parameter the way OpenAI does, without HTTP or Redis."""

from __future__ import annotations

import json

import pytest

from flatfare.billing.plans import AccountTerms, PlanRules
from flatfare.contract import Endpoint
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.checks import check_caps
from flatfare.gateway.openai.service import parse_body
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
