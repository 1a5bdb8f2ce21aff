"""Request validation names the offending parameter the way OpenAI does, without HTTP or Redis."""

from __future__ import annotations

import pytest

from flatfare.contract import Endpoint
from flatfare.gateway.openai.service import parse_body
from flatfare.gateway.errors import APIError


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
