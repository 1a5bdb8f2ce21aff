"""OpenAI's Responses API through the official ``openai`` SDK on the real CPU engine (issue 23 items 2
and 5): vLLM's own Responses serving in the worker, Flatfare's store in SQL.

The default model (SmolLM2-135M-Instruct, the Hermes tool parser, ``tool_strict_level`` "parameter")
must call a tool when ``tool_choice`` is "required"; the tool's only parameter is an enum, which keeps
the call short. The follow-up turn names the earlier response by ``previous_response_id``: the gateway
gives the worker the whole conversation, the worker's vLLM keeps nothing between requests."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.contract import quota_counter_key
from tests.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CITIES = ["Paris", "London", "Tokyo"]
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                                    "required": ["city"], "additionalProperties": False}}]
ASK = "What is the capital of France?"


def _client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return _client(stack, stack.api_key)


@pytest.fixture(scope="module")
def other(stack: Stack) -> openai.OpenAI:
    """A client of another account."""
    created = stack.cli("keys", "create", "--account", "e2e-responses-other", "--plan", "pro")
    assert created.returncode == 0, created.stderr
    return _client(stack, created.stdout.strip())


def _units(stack: Stack) -> int:
    """The stack account's quota units counted today."""
    (account_id,), = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return int(client.get(quota_counter_key(account_id, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()


def _ledger(stack: Stack, request_id: str) -> list[tuple]:
    """The request's ledger rows: (endpoint, billable, status, whether it counted prompt and output tokens)."""
    return [(endpoint, bool(billable), status, prompt > 0 and output > 0) for endpoint, billable, status, prompt, output
            in stack.sql("SELECT endpoint, billable, status, prompt_tokens, completion_tokens FROM requests "
                         "WHERE id = :id", id=request_id)]


def _request_id(stack: Stack, response_id: str) -> str:
    (request_id,), = stack.sql("SELECT request_id FROM stored_responses WHERE id = :id", id=response_id)
    return request_id


def test_a_text_response_is_stored_for_its_account_only(stack: Stack, client: openai.OpenAI,
                                                          other: openai.OpenAI) -> None:
    units = _units(stack)
    response = client.responses.create(model=MODEL, input=ASK, instructions="Answer in one sentence.",
                                       max_output_tokens=32, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output_text.strip(), response
    assert "Paris" in response.output_text, response.output_text
    assert response.store is True and response.usage and response.usage.output_tokens > 0
    # One request: one quota unit, one ledger row (billable), the stored response pointing at it.
    assert _units(stack) == units + 1
    assert _ledger(stack, _request_id(stack, response.id)) == [("responses", True, "succeeded", True)]

    kept = client.responses.retrieve(response.id)
    assert kept.id == response.id and kept.output_text == response.output_text
    items = client.responses.input_items.list(response.id, order="asc")
    assert [item.role for item in items.data] == ["user"], items
    for stranger in (lambda: other.responses.retrieve(response.id),
                     lambda: other.responses.input_items.list(response.id),
                     lambda: other.responses.delete(response.id),
                     lambda: other.responses.create(model=MODEL, input="Go on.", max_output_tokens=8,
                                                    previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError):
            stranger()
    assert client.responses.retrieve(response.id).id == response.id  # the stranger's delete did nothing
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_store_false_is_answered_and_not_kept(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=16, temperature=0, store=False)
    assert response.output_text and response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_forced_function_call_then_its_output_through_previous_response_id(stack: Stack,
                                                                             client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Paris right now?", tools=TOOLS,
                                    tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    assert json.loads(calls[0].arguments)["city"] in CITIES, calls[0].arguments
    units = _units(stack)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=48, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 22 C"}])
    assert second.previous_response_id == first.id
    assert second.output_text.strip() and not [i for i in second.output if i.type == "function_call"], second.output
    # The engine was given the whole conversation: the question, the call, its output.
    assert second.usage and second.usage.input_tokens > first.usage.input_tokens
    given = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in given] == ["message", "function_call", "function_call_output"], given
    assert _units(stack) == units + 1
    assert _ledger(stack, _request_id(stack, second.id)) == [("responses", True, "succeeded", True)]


def test_streamed_events_reach_the_sdk_and_the_final_response_is_stored(stack: Stack,
                                                                        client: openai.OpenAI) -> None:
    units = _units(stack)
    # On the wire as OpenAI sends it: each event named on its own line, and no [DONE].
    wire = _wire(stack)
    assert len(wire) % 2 == 0 and "data: [DONE]" not in wire, wire
    for named, data in zip(wire[::2], wire[1::2]):
        assert named == f"event: {json.loads(data.removeprefix('data: '))['type']}", (named, data)
    events = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=32, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds, kinds
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text and text == final.output_text and final.store is True
    assert [event.sequence_number for event in events] == sorted(event.sequence_number for event in events)
    kept = client.responses.retrieve(final.id)
    assert kept.output_text == text and kept.status == final.status
    assert _units(stack) == units + 2  # this one and the raw one below
    assert _ledger(stack, _request_id(stack, final.id)) == [("responses", True, "succeeded", True)]


def _wire(stack: Stack) -> list[str]:
    """A streamed response's SSE lines, as any client reads them."""
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", timeout=300,
                      headers={"Authorization": f"Bearer {stack.api_key}"},
                      json={"model": MODEL, "input": ASK, "max_output_tokens": 8, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        return [line for line in answer.iter_lines() if line]


def test_bad_input_is_refused_before_anything_is_counted(stack: Stack, client: openai.OpenAI) -> None:
    units = _units(stack)
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "http://169.254.169.254/x.png"}]}]}, "input[0].content[0]"),
        ({"input": ASK, "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"input": ASK, "max_output_tokens": 10 ** 6}, "max_output_tokens"),
        ({"input": ASK, "background": True}, "background"),
    ]
    for fields, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, **fields)
        assert refused.value.body and refused.value.body.get("param") == param, (fields, refused.value.body)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input=ASK, previous_response_id="resp_none")
    assert _units(stack) == units


def test_a_json_schema_text_format_holds_the_output_to_it(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Name a city in France.", max_output_tokens=32,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                       "schema": schema, "strict": True}})
    assert json.loads(response.output_text)["city"] in CITIES, response.output_text
    # The format comes back as it was sent (the schema under its own name, "schema").
    kept = client.responses.retrieve(response.id).model_dump(by_alias=True)
    assert kept["text"]["format"]["schema"] == schema, kept["text"]
