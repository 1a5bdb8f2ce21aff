"""Function calling out of the box: the default model (SmolLM2-135M-Instruct, whose catalog entry the
migrations give the Hermes parser, automatic tool choice, ``tool_strict_level`` "parameter" and the
shipped ``chatml-tools`` template)
answers tools in every tool_choice mode, streamed and not, through the official ``openai`` SDK on the
real CPU engine, and takes the follow-up turn with the tool's result.

A 135M model rarely decides to call a tool by itself, so ``auto`` is held to what the API promises: a
well-formed answer, either text or a parsed call. Every call is constrained by the tool's schema in the
engine (the strict level), so forced calls (``required``, a named function) always come back valid;
the tool's only parameter is an enum, which keeps them about 36 tokens long (with the schema's
whitespace): 64 leaves room."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CITIES = ["Paris", "London", "Tokyo"]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)


def assert_valid_call(name: str | None, arguments: str | None) -> None:
    assert name == "get_weather", name
    assert json.loads(arguments or "")["city"] in CITIES, arguments


def streamed_call(client: openai.OpenAI, **fields: Any) -> tuple[str | None, str, str]:
    """(name, arguments, content) of a streamed answer's first tool call, put together from its deltas."""
    name, arguments, content = None, "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                                temperature=0, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            name = call.function.name or name if call.function else name
            arguments += (call.function.arguments or "") if call.function else ""
    return name, arguments, content


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_is_a_valid_call_streamed_or_not(client: openai.OpenAI, choice: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=64, temperature=0)
    calls = whole.choices[0].message.tool_calls
    assert calls and len(calls) >= 1 and calls[0].id and calls[0].type == "function", whole
    assert_valid_call(calls[0].function.name, calls[0].function.arguments)
    name, arguments, _ = streamed_call(client, tool_choice=choice)
    assert_valid_call(name, arguments)


def test_auto_answers_with_text_or_a_parsed_call_streamed_or_not(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0)
    message = whole.choices[0].message
    if message.tool_calls:
        assert_valid_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
        assert whole.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content and "<tool_call>" not in message.content, message
    name, arguments, content = streamed_call(client, tool_choice="auto")
    assert (name is not None and json.loads(arguments)["city"] in CITIES) or (content and "<tool_call>" not in content)


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert whole.choices[0].message.content and not whole.choices[0].message.tool_calls


def test_the_tool_result_turn_is_answered(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls, answer
