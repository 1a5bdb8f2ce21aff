"""Requests that would cost the engine far more than their size are refused by validation alone:
a 400 naming the parameter, within 100 ms, before anything is counted (no HTTP, Redis or SQL here)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from flatfare.contract import Endpoint
from flatfare.gateway.openai import grammar_caps
from flatfare.gateway.openai.kinds import parse_body
from flatfare.gateway.errors import APIError
from tests.security.timing import fast

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True, scope="module")
def _no_full_collections() -> Iterator[None]:
    """The 100 ms bound is the gateway's, not the test process's: a full garbage collection over
    everything pytest has loaded (100+ ms here) must not land inside a timed parse."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def refusal(body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> APIError:
    """The APIError validation raises for ``body``, which must come within 100 ms."""
    raw = orjson.dumps(body)

    def attempt() -> APIError:
        with pytest.raises(APIError) as caught:
            parse_body(endpoint, raw)
        return caught.value

    error = fast(attempt)
    assert 400 <= error.status < 500
    return error


def accepted(body: dict[str, Any], endpoint: Endpoint = Endpoint.CHAT) -> None:
    parse_body(endpoint, orjson.dumps(body))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def nested(depth: int) -> dict[str, Any]:
    """An object schema whose two properties are the level below: it doubles in size at each level."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": schema}, "required": ["a", "b"]}
    return schema


# -- n, best_of, log probabilities, stop sequences, logit_bias --------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 10_000}, "n"),
    ({"best_of": 1000}, "best_of"),
    ({"n": 4, "best_of": 2}, "best_of"),
    ({"top_logprobs": 1000, "logprobs": True}, "top_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # -1: every vocabulary entry for every prompt token
    ({"prompt_logprobs": 100}, "prompt_logprobs"),
    ({"stop": ["x"] * 5}, "stop"),
    ({"stop": "x" * 513}, "stop"),
    ({"stop": ["ok", "x" * 513]}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_multipliers_are_bounded(fields: dict[str, Any], param: str) -> None:
    assert refusal(chat(**fields)).param == param


def test_completion_logprobs_and_best_of_are_bounded() -> None:
    base = {"model": "m", "prompt": "hi"}
    assert refusal({**base, "logprobs": 50}, Endpoint.COMPLETION).param == "logprobs"
    assert refusal({**base, "best_of": 21}, Endpoint.COMPLETION).param == "best_of"
    accepted({**base, "logprobs": 5, "best_of": 3, "n": 2}, Endpoint.COMPLETION)


def test_ordinary_sampling_parameters_pass() -> None:
    accepted(chat(n=4, top_logprobs=20, logprobs=True, stop=["\n\n", "END"], logit_bias={"50256": -100}))


# -- fields a platform serving strangers does not take ------------------------------------------

@pytest.mark.parametrize("name", ["chat_template", "mm_processor_kwargs", "media_io_kwargs", "kv_transfer_params",
                                  "prompt_embeds"])
def test_engine_internals_are_refused(name: str) -> None:
    value: Any = "{{ range(10**9) | list }}" if name == "chat_template" else {"video": {"num_frames": 100_000}}
    error = refusal(chat(**{name: value}))
    assert (error.param, error.code) == (name, "unsupported_parameter")


# -- output grammars: schemas ------------------------------------------------------------------

def test_a_schema_that_doubles_at_each_level_is_refused_by_size() -> None:
    # Compile time grows faster than size (184 KB: 1.2 s, 368 KB: 3.8 s); nested(10) is 92 KB.
    error = refusal(chat(response_format=json_schema(nested(10))))
    assert (error.param, error.code) == ("response_format", "schema_too_large")


def test_deep_nesting_is_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    error = refusal(chat(response_format=json_schema(schema)))
    assert error.code == "schema_too_deep" and error.param.startswith("response_format.json_schema.schema")


def test_remote_references_are_refused() -> None:
    schema = {"$ref": "http://169.254.169.254/latest/meta-data/"}
    error = refusal(chat(response_format=json_schema(schema)))
    assert (error.param, error.code) == ("response_format.json_schema.schema.$ref", "invalid_schema")
    accepted(chat(response_format=json_schema({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"})))


@pytest.mark.parametrize("pattern", [
    "(.{0,8}){0,8}",  # 7.8 s to compile (46k-token vocabulary)
    "(.{0,16}){0,16}",  # 91 s
    "(.{0,2}){0,16}",  # 2 s
    "((a{2}){3}){4}",
    "[a-z]{1,5000}",
    "a" * 1001,
])
def test_catastrophic_patterns_in_a_schema_are_refused(pattern: str) -> None:
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": pattern}}}
    error = refusal(chat(response_format=json_schema(schema)))
    assert error.param == "response_format.json_schema.schema.properties.id.pattern"
    assert error.code == "pattern_too_complex"


def test_a_property_named_like_a_keyword_is_still_checked() -> None:
    schema = {"type": "object", "properties": {"enum": {"type": "string", "pattern": "(.{0,9}){0,9}"}}}
    assert refusal(chat(response_format=json_schema(schema))).code == "pattern_too_complex"


@pytest.mark.parametrize("pattern", [
    r"^(\d{1,3}\.){3}\d{1,3}$",  # IPv4
    r"^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$",  # UUID
    r"^\d{4}-\d{2}-\d{2}$",
    r"^[A-Z]{2}[0-9]{4}$",
    r"^([a-z0-9]+\.)+[a-z]{2,63}$",
    r"^\p{L}+$",
    r"(a|aa)*b",  # backtracking-catastrophic, harmless to an automaton
])
def test_ordinary_patterns_pass(pattern: str) -> None:
    accepted(chat(response_format=json_schema({"type": "string", "pattern": pattern})))
    accepted(chat(structured_outputs={"regex": pattern}))


def test_structured_outputs_regex_grammar_and_legacy_fields_are_bounded() -> None:
    assert refusal(chat(structured_outputs={"regex": "(.{0,8}){0,8}"})).param == "structured_outputs.regex"
    assert refusal(chat(structured_outputs={"grammar": "root ::= " + "a" * 20_000})).code == "grammar_too_large"
    assert refusal(chat(guided_regex="(.{0,8}){0,8}")).param == "guided_regex"
    assert refusal(chat(guided_json=orjson.dumps(nested(10)).decode())).param == "guided_json"
    error = refusal(chat(structured_outputs={"json": {"type": "string", "pattern": "(x{0,9}){0,9}"}}))
    assert error.param == "structured_outputs.json.pattern"
    assert refusal(chat(structured_outputs={"regex": "(unclosed"})).code == "invalid_pattern"


def test_completions_take_the_same_caps() -> None:
    body = {"model": "m", "prompt": "hi", "structured_outputs": {"regex": "(.{0,8}){0,8}"}}
    assert refusal(body, Endpoint.COMPLETION).param == "structured_outputs.regex"


# -- tools ---------------------------------------------------------------------------------------

def tool(i: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters or {"type": "object"}}}


def test_tools_are_bounded_in_number_size_and_patterns() -> None:
    assert refusal(chat(tools=[tool(i) for i in range(129)])).param == "tools"
    assert refusal(chat(tools=[tool(0, nested(10))])).param == "tools[0]"
    bulky = {"type": "object", "description": "x" * 30_000}
    assert refusal(chat(tools=[tool(i, bulky) for i in range(5)])).code == "schema_too_large"
    error = refusal(chat(tools=[tool(0), tool(1, {"type": "string", "pattern": "(.{0,8}){0,8}"})]))
    assert error.param == "tools[1].function.parameters.pattern"
    accepted(chat(tools=[tool(i) for i in range(128)], tool_choice="required"))


# -- the digest the per-account grammar budget counts ---------------------------------------------

def test_only_requests_that_compile_a_grammar_of_their_own_have_a_digest() -> None:
    assert grammar_caps.constraint_digest({"response_format": {"type": "json_object"}}) is None
    assert grammar_caps.constraint_digest({"tools": [tool(0)], "tool_choice": "none"}) is None
    # auto: compiled under a strict level (the default model's) or for a strict tool, so counted
    assert grammar_caps.constraint_digest({"tools": [tool(0)], "tool_choice": "auto"}) is not None
    assert grammar_caps.constraint_digest({"tools": [tool(0)]}) is not None
    one = grammar_caps.constraint_digest({"response_format": json_schema({"type": "string", "maxLength": 5})})
    same = grammar_caps.constraint_digest({"response_format": json_schema({"maxLength": 5, "type": "string"})})
    other = grammar_caps.constraint_digest({"response_format": json_schema({"type": "string", "maxLength": 6})})
    assert one == same != other
    assert grammar_caps.constraint_digest({"tools": [tool(0)], "tool_choice": "required"}) is not None


def test_repetition_cost_reads_the_usual_dialects() -> None:
    assert grammar_caps.repetition_cost(r"\p{L}{2,5}") == (5, 1)
    assert grammar_caps.repetition_cost("[{]{3}x{,4}") == (4, 1)
    assert grammar_caps.repetition_cost("(a{5}b){3}") == (5, 15)
    with pytest.raises(ValueError):
        grammar_caps.repetition_cost("[abc")
