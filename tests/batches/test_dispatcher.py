"""A batch line is admitted as the same request sent live would be (flatfare.gateway.openai.admission):
refused with the live path's status, code and message, free, or queued with the body a live job would
carry. Each case here had drifted in the batch's own copy of the checks (issue 31): the input-token
cap, the request screen, the output cap within the model's context, the key's refusal code.

One gateway process in the test's loop (tests/gateway/rig.py): its batch dispatcher validates the batch
while no engine runs, so every line stays pending or fails at validation."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.rig import CHAT_CONTEXT, CHAT_MODEL, EMBEDDER, Gateway, in_process_gateway

CHAT = "/v1/chat/completions"
# A line admitted at validation waits for its pool, or is already fed to it.
ADMITTED = ("pending", "queued")


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path) as gateway:
        yield gateway


def _chat(content: Any, **fields: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], **fields}


async def _batch(gateway: Gateway, bodies: list[dict[str, Any]], key: str | None = None) -> list[tuple[Any, ...]]:
    """Run a batch of ``bodies`` through validation; (status, status_code, body, result) of each line."""
    auth = {"Authorization": f"Bearer {key}"} if key else gateway.auth
    data = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body}) + "\n"
                   for i, body in enumerate(bodies)).encode()
    uploaded = await gateway.client.post("/v1/files", files={"file": ("lines.jsonl", data)}, data={"purpose": "batch"},
                                         headers=auth)
    assert uploaded.status_code == 200, uploaded.text
    created = await gateway.client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT,
                                                             "completion_window": "24h"}, headers=auth)
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    deadline = time.monotonic() + 20
    while (await gateway.client.get(f"/v1/batches/{batch_id}", headers=auth)).json()["status"] == "validating":
        assert time.monotonic() < deadline, "the batch was never validated"
        await asyncio.sleep(0.05)
    return await gateway.sql("SELECT status, status_code, body, result FROM batch_lines WHERE batch_id = :b "
                             "ORDER BY line", b=batch_id)


def _refused(line: tuple[Any, ...], live: httpx.Response) -> dict[str, Any]:
    """The line failed, free, with exactly the error the live request got."""
    status, status_code, _body, result = line
    assert live.status_code >= 400, live.text
    assert (status, status_code) == ("failed", live.status_code), line
    assert json.loads(result) == live.json()
    return live.json()["error"]


async def _pro(gateway: Gateway, **values: Any) -> None:
    """Change the Pro plan and wait until the gateway's plan cache has it."""
    sets = ", ".join(f"{name} = :{name}" for name in values)
    await gateway.sql(f"UPDATE plans SET {sets} WHERE name = 'pro'", **values)
    await asyncio.sleep(0.6)


async def test_a_line_over_the_plan_s_input_tokens_is_refused_free_with_the_live_code(gateway: Gateway) -> None:
    await _pro(gateway, max_prompt_tokens=64)
    body = _chat("word " * 200)
    [line] = await _batch(gateway, [body])
    live = await gateway.client.post(CHAT, json=body, headers=gateway.auth)
    assert _refused(line, live)["code"] == "prompt_too_long"
    assert (await gateway.counted())[0] == 0


async def test_a_line_passes_the_request_screen_media_hosts(gateway: Gateway,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A media host whose name resolves to a private address is refused before the worker would fetch it."""
    resolve = socket.getaddrinfo

    def private(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "media.example.com":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0))]
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", private)
    body = _chat([{"type": "image_url", "image_url": {"url": "https://media.example.com/cat.png"}}])
    [line] = await _batch(gateway, [body])
    live = await gateway.client.post(CHAT, json=body, headers=gateway.auth)
    assert "10.1.2.3" in _refused(line, live)["message"]


async def test_a_line_passes_the_request_screen_new_grammars_a_minute(gateway: Gateway) -> None:
    """Every line with a schema of its own makes the engine compile it: the account's new grammars a
    minute bound a batch as they bound live requests (the default screen: 30 a minute)."""
    schemas = [_chat("hi", response_format={"type": "json_schema", "json_schema": {
        "name": f"s{i}", "schema": {"type": "object", "properties": {f"field{i}": {"type": "string"}}}}})
        for i in range(31)]
    lines = await _batch(gateway, schemas)
    assert [line[0] in ADMITTED for line in lines] == [True] * 30 + [False]
    status, status_code, _, result = lines[30]
    assert (status_code, json.loads(result)["error"]["code"]) == (429, "too_many_new_schemas")


async def test_a_line_without_an_output_limit_gets_the_plan_s_cap_within_the_model_s_context(
        gateway: Gateway) -> None:
    """Pro caps output at 4,096 tokens; the model's context is 2,048: the live path fills in the smaller."""
    [line] = await _batch(gateway, [_chat("hi")])
    assert line[0] in ADMITTED
    assert json.loads(line[2])["max_completion_tokens"] == CHAT_CONTEXT


async def test_a_line_for_a_model_the_key_may_not_use_is_refused_with_the_live_code(gateway: Gateway) -> None:
    key = await gateway.new_key(name="embeddings only", allowed_models=[EMBEDDER])
    body = _chat("hi")
    [line] = await _batch(gateway, [body], key=key)
    live = await gateway.client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
    assert _refused(line, live)["code"] == "model_not_allowed_for_key"
