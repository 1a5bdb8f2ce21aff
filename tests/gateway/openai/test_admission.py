"""What makes a request admissible (flatfare.gateway.openai.admission), through the live routes of one
gateway process (tests/gateway/rig.py): each refusal is the one the client gets, before anything is
counted, queued or written. The batch's use of the same step is tests/batches/test_dispatcher.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.rig import CHAT_MODEL, Gateway, in_process_gateway


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path) as gateway:
        yield gateway


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], **fields}


async def _refused(gateway: Gateway, path: str, body: dict[str, Any], status: int, code: str) -> dict[str, Any]:
    response = await gateway.client.post(path, json=body, headers=gateway.auth)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert await gateway.counted() == (0, 0)  # no unit counted, no ledger row
    return error


async def test_a_live_prompt_over_the_plan_s_input_tokens_is_refused_before_it_is_counted(gateway: Gateway) -> None:
    await gateway.sql("UPDATE plans SET max_prompt_tokens = 64 WHERE name = 'pro'")
    gateway.refresh_plans()
    error = await _refused(gateway, "/v1/chat/completions", _chat("word " * 200), 400, "prompt_too_long")
    assert "at most 64 input tokens" in error["message"]
    await _refused(gateway, "/v1/completions", {"model": CHAT_MODEL, "prompt": "word " * 200}, 400,
                   "prompt_too_long")
    await _refused(gateway, "/v1/responses", {"model": CHAT_MODEL, "input": "word " * 200}, 400, "prompt_too_long")


async def test_a_responses_request_continuing_an_unknown_response_is_refused(gateway: Gateway) -> None:
    error = await _refused(gateway, "/v1/responses", {"model": CHAT_MODEL, "input": "hi",
                                                       "previous_response_id": "resp_none"},
                           404, "previous_response_not_found")
    assert error["param"] == "previous_response_id"


async def test_the_catalog_is_read_once_per_request(gateway: Gateway) -> None:
    pools = gateway.services.pools
    reads = 0
    catalog = pools.catalog

    async def counted() -> Any:
        nonlocal reads
        reads += 1
        return await catalog()

    pools.catalog = counted
    await _refused(gateway, "/v1/chat/completions", _chat("hi", n=99), 400, "too_many_sequences")
    assert reads == 0  # refused on the plan's caps, before the catalog
    await gateway.sql("UPDATE plans SET max_prompt_tokens = 8 WHERE name = 'pro'")
    gateway.refresh_plans()
    await _refused(gateway, "/v1/chat/completions", _chat("word " * 20), 400, "prompt_too_long")
    assert reads == 1
