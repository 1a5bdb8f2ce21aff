"""Job kinds declared in one place, and what the gateway refuses of an embeddings request before anything
is counted: the registry's rows on both sides, unknown routes, the wire model, the plan's caps on inputs
and tokens, ``dimensions`` against what the model's engines report, and the capability each kind needs.

One gateway process in the test's loop (tests/gateway/rig.py), migrated, so the catalog holds the
built-in embedding model ``all-minilm-l6-v2`` (migration 0013). Its worker is its heartbeat: every
request here is refused before any worker would be asked, which tests/e2e/test_embeddings.py checks on
the real engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from flatfare.capabilities import capabilities_of
from flatfare.contract import ENDPOINT_PATHS, Endpoint
from flatfare.gateway.admin.schemas import PlanUpdate
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.asgi import ROUTES
from flatfare.gateway.openai.kinds import KINDS, parse_body
from flatfare.storage.db import create_engine, session_factory
from flatfare.storage.models import Plan, RequestRecord
from flatfare.workers.engine import SERVING
from tests.gateway.rig import CHAT_MODEL, EMBEDDER, EMBEDDER_CONTEXT, Gateway, in_process_gateway

CONTEXT = EMBEDDER_CONTEXT


def test_every_kind_has_its_row_on_both_sides_and_its_route() -> None:
    assert set(KINDS) == set(SERVING) == set(Endpoint) == set(ENDPOINT_PATHS)
    assert set(ROUTES.values()) == set(Endpoint)
    for endpoint, kind in KINDS.items():
        assert kind.endpoint is endpoint and ROUTES[endpoint.path] is endpoint
    assert [e for e, k in KINDS.items() if k.embeds] == [Endpoint.EMBEDDINGS]
    assert KINDS[Endpoint.EMBEDDINGS].output_param is None  # no text out: no output cap to fill in


def test_the_embeddings_wire_model_takes_openai_s_inputs_and_refuses_the_rest() -> None:
    for given, count in (("hi", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2)):
        _, parsed = parse_body(Endpoint.EMBEDDINGS, httpx.Request("POST", "/", json={
            "model": "m", "input": given, "encoding_format": "base64", "user": "u"}).content)
        assert len(parsed.inputs()) == count, given
    for body, param in (({"input": []}, "input"), ({"input": [[1], []]}, "input"), ({"input": ["a", ""]}, "input"),
                        ({"input": ["a", 1]}, "input"), ({"input": "a", "encoding_format": "bytes"}, "encoding_format"),
                        ({"input": "a", "dimensions": 0}, "dimensions"), ({}, "input")):
        with pytest.raises(APIError) as refused:
            parse_body(Endpoint.EMBEDDINGS, httpx.Request("POST", "/", json={"model": "m", **body}).content)
        assert refused.value.status == 400 and refused.value.param == param, (body, refused.value.message)


def test_the_embeddings_capability_comes_from_the_entry_s_runner() -> None:
    assert capabilities_of({"runner": "pooling"}).public()["embeddings"]
    assert capabilities_of({"convert": "embed"}).embeddings
    assert not capabilities_of({"runner": "pooling", "convert": "classify"}).embeddings
    shown = capabilities_of({"runner": "pooling"}).public()
    assert not shown["json_mode"] and not shown["structured_outputs"]  # it generates no text
    assert not capabilities_of({"tool_call_parser": "hermes"}).public()["embeddings"]


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path) as gateway:
        yield gateway


def _error(response: httpx.Response, status: int, code: str | None, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param), error
    return error["message"]


async def test_unknown_v1_routes_answer_404_in_openai_s_envelope(gateway: Gateway) -> None:
    _error(await gateway.client.post("/v1/anything", json={}, headers=gateway.auth), 404, "not_found", None)
    _error(await gateway.client.get("/v1/nope", headers=gateway.auth), 404, "not_found", None)
    paths = (await gateway.client.get("/openapi.json")).json()["paths"]
    assert set(ENDPOINT_PATHS.values()) <= set(paths)


async def test_v1_models_shows_which_model_embeds(gateway: Gateway) -> None:
    cards = {card["id"]: card for card in (await gateway.client.get("/v1/models", headers=gateway.auth)).json()["data"]}
    assert cards[EMBEDDER]["capabilities"]["embeddings"] and not cards[EMBEDDER]["capabilities"]["json_mode"]
    assert cards[EMBEDDER]["context_length"] == CONTEXT
    assert not cards[CHAT_MODEL]["capabilities"]["embeddings"]


def _embed(**body: Any) -> dict[str, Any]:
    return {"model": EMBEDDER, "input": "hello", **body}


# Each is refused before anything is counted; pro allows 256 inputs and 32,768 input tokens a request.
REFUSED = {
    "more inputs than the plan allows": (_embed(input=["x"] * 257), 400, "too_many_inputs", "input"),
    "an input longer than the model's context": (_embed(input=[[7] * 10, [7] * (CONTEXT + 1)]), 400,
                                                 "context_length_exceeded", "input[1]"),
    "inputs together over the plan's input tokens": (_embed(input=[[7] * CONTEXT] * 129), 400, "prompt_too_long",
                                                     "input"),
    "dimensions on a model without Matryoshka embeddings": (_embed(dimensions=64), 400, "invalid_value",
                                                            "dimensions"),
    "embeddings of a chat model": ({"model": CHAT_MODEL, "input": "hello"}, 400, "unsupported_capability", "model"),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_an_embeddings_request_over_a_bound_is_refused_naming_it_and_counts_nothing(
        gateway: Gateway, case: str) -> None:
    body, status, code, param = REFUSED[case]
    message = _error(await gateway.client.post("/v1/embeddings", json=body, headers=gateway.auth), status, code, param)
    assert await gateway.counted() == (0, 0), message


async def test_a_chat_request_to_an_embedding_model_is_refused_naming_the_capability(gateway: Gateway) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        message = _error(await gateway.client.post(path, json={"model": EMBEDDER, **body}, headers=gateway.auth),
                         400, "unsupported_capability", "model")
        assert "embedding model" in message and "/v1/embeddings" in message
    assert await gateway.counted() == (0, 0)


async def test_an_embeddings_request_within_its_bounds_is_admitted_and_recorded(gateway: Gateway) -> None:
    """No engine answers here: the request is admitted (its unit counted, its row written) and ends at the
    gateway's timeout, free. That it is answered is tests/e2e/test_embeddings.py's, on the real engine."""
    response = await gateway.client.post("/v1/embeddings", json=_embed(input=["a", "b"]), headers=gateway.auth)
    _error(response, 504, "timeout", None)
    assert await gateway.counted() == (0, 1)  # its unit given back; one ledger row
    engine = create_engine(gateway.database_url)
    try:
        async with session_factory(engine)() as session:
            row = (await session.scalars(select(RequestRecord))).one()
    finally:
        await engine.dispose()
    assert (row.endpoint, row.model, row.stream, row.billable) == ("embeddings", EMBEDDER, False, False)


async def test_the_plan_s_embedding_inputs_are_data_an_operator_changes(gateway: Gateway) -> None:
    """The cap is the plans table's ``max_embedding_inputs`` (the admin API's plan field): a change reaches
    the gateway through its plan cache. Three inputs with ``dimensions`` are refused either way, for
    ``dimensions`` first, then, once the cap of 2 is seen, for the inputs (caps come first)."""
    for refused in ({"max_embedding_inputs": 0}, {"max_embedding_inputs": None}):
        with pytest.raises(ValidationError):
            PlanUpdate.model_validate(refused)
    engine = create_engine(gateway.database_url)
    try:
        async with session_factory(engine)() as session, session.begin():
            await session.execute(update(Plan).where(Plan.name == "pro").values(max_embedding_inputs=2))
    finally:
        await engine.dispose()
    deadline = time.monotonic() + 20
    while True:
        response = await gateway.client.post("/v1/embeddings", json=_embed(input=["a", "b", "c"], dimensions=8),
                                             headers=gateway.auth)
        if response.json()["error"]["code"] == "too_many_inputs":
            break
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.1)
    assert "allows at most 2" in _error(response, 400, "too_many_inputs", "input")
    assert await gateway.counted() == (0, 0)
