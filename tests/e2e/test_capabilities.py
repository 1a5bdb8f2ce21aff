"""What a model offers is visible and kept: /v1/models shows each model's context length and the
capabilities its catalog entry gives it, only to callers whose plan may use it; a request that needs a
capability its model lacks gets a 400 naming both, before anything is counted or recorded. On the
instant engine (the checks are the gateway's, before any engine)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.contract import quota_counter_key
from tests.conftest import Stack, eventually, launch_admin_stack

pytestmark = pytest.mark.e2e

MODEL = "instant"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJ"
       "RU5ErkJggg==")


@pytest.fixture(scope="module")
def cstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_admin_stack(tmp_path_factory.mktemp("capabilities"), "capabilities") as stack:
        yield stack


@pytest.fixture(scope="module")
def admin(cstack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{cstack.base_url}/admin/v1", timeout=30,
                      headers={"Authorization": f"Bearer {cstack.admin_token}"}) as client:  # type: ignore[attr-defined]
        yield client


def client_for(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=30, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def http(cstack: Stack) -> Iterator[httpx.Client]:
    with client_for(cstack, cstack.api_key) as client:  # the pro plan
        yield client


def cards(http: httpx.Client) -> dict[str, dict[str, Any]]:
    listed = http.get("/v1/models")
    assert listed.status_code == 200, listed.text
    return {card["id"]: card for card in listed.json()["data"]}


def set_options(admin: httpx.Client, http: httpx.Client, options: dict[str, Any]) -> None:
    """Give the instant model a catalog entry with these engine options; wait until the gateway sees it."""
    if admin.get(f"/models/{MODEL}").status_code == 404:
        created = admin.post("/models", json={"name": MODEL, "source": "instant", "engine_options": options})
        assert created.status_code == 201, created.text
    else:
        changed = admin.patch(f"/models/{MODEL}", json={"engine_options": options})
        assert changed.status_code == 200, changed.text
    expected = admin.get(f"/models/{MODEL}").json()["capabilities"]
    eventually(lambda: cards(http).get(MODEL, {}).get("capabilities"), lambda c: c == expected,
               "the catalog change on /v1/models")


def spent(stack: Stack) -> tuple[int, int]:
    """(ledger rows, quota units counted today) of the e2e account."""
    account = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        units = int(client.get(quota_counter_key(account, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()
    return stack.sql("SELECT count(*) FROM requests")[0][0], units


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 4, **fields})


def assert_lacks(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("unsupported_capability", param,
                                                              "invalid_request_error"), error
    assert f"'{MODEL}'" in error["message"] and all(w in error["message"] for w in words), error
    assert "--" not in error["message"]  # no vLLM flag


def test_models_show_context_length_capabilities_and_state(cstack: Stack, admin: httpx.Client,
                                                           http: httpx.Client) -> None:
    assert cards(http)[MODEL]["capabilities"] is None  # outside the catalog: not described
    set_options(admin, http, {"max_model_len": 4096})
    card = cards(http)[MODEL]
    assert card["object"] == "model" and card["owned_by"] == "flatfare" and card["state"] == "warm"
    assert card["context_length"] == 1 << 20  # the live worker's, which wins over the catalog's
    assert card["capabilities"] == {"tools": False, "auto_tool_choice": False, "json_mode": True,
                                    "structured_outputs": True, "reasoning": False, "vision": False,
                                    "audio": False, "video": False, "embeddings": False}
    assert http.get(f"/v1/models/{MODEL}").json() == card
    smol = cards(http)["smollm2-135m-instruct"]  # pinned, no worker here: the catalog's context
    assert smol["state"] == "unavailable" and smol["context_length"] == 2048 and smol["capabilities"]["auto_tool_choice"]


def test_a_request_needing_what_the_model_lacks_is_refused_free(cstack: Stack, admin: httpx.Client,
                                                                http: httpx.Client) -> None:
    set_options(admin, http, {"max_model_len": 4096})
    before = spent(cstack)
    assert_lacks(chat(http, tools=[TOOL]), "tools", "function calling")
    assert_lacks(chat(http, tools=[TOOL], tool_choice="required"), "tools", "function calling")
    image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                          {"type": "image_url", "image_url": {"url": PNG}}]}]
    assert_lacks(chat(http, messages=image), "messages[0].content[1].image_url.url", "vision")
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    assert_lacks(chat(http, messages=audio), "messages[0].content[0].input_audio", "audio")
    assert_lacks(chat(http, reasoning_effort="high"), "reasoning_effort", "reasoning")
    assert spent(cstack) == before  # no ledger row, no unit
    # What the model does offer goes through: tools it is told not to use, JSON mode.
    assert chat(http, tools=[TOOL], tool_choice="none").status_code == 200
    assert chat(http, response_format={"type": "json_object"}).status_code == 200


def test_capabilities_follow_the_catalog_entry(cstack: Stack, admin: httpx.Client, http: httpx.Client) -> None:
    set_options(admin, http, {"tool_call_parser": "hermes", "limit_mm_per_prompt": {"image": 1}})
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(http, tools=[TOOL], tool_choice="required").status_code == 200
    assert chat(http, tools=[TOOL], tool_choice=named).status_code == 200
    assert_lacks(chat(http, tools=[TOOL]), "tool_choice", "automatic tool choice", "'required'")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]
    assert chat(http, messages=image).status_code == 200
    set_options(admin, http, {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                              "reasoning_parser": "qwen3"})
    assert chat(http, tools=[TOOL]).status_code == 200
    assert chat(http, reasoning_effort="low").status_code == 200
    assert_lacks(chat(http, messages=image), "messages[0].content[0].image_url.url", "vision")


def test_the_list_shows_only_the_models_the_callers_plan_may_use(cstack: Stack, admin: httpx.Client,
                                                                 http: httpx.Client) -> None:
    created = admin.post("/models", json={"name": "big-premium", "source": "x/y", "plans": ["premium"],
                                          "pinned": True})
    assert created.status_code == 201, created.text
    premium_key = cstack.cli("keys", "create", "--account", "rich", "--plan", "premium")
    free_key = cstack.cli("keys", "create", "--account", "thrifty", "--plan", "free")
    assert premium_key.returncode == 0 and free_key.returncode == 0, (premium_key.stderr, free_key.stderr)
    with client_for(cstack, premium_key.stdout.strip()) as premium, client_for(cstack, free_key.stdout.strip()) as free:
        eventually(lambda: set(cards(premium)), lambda ids: "big-premium" in ids, "the new entry listed")
        assert {"big-premium", MODEL, "smollm2-135m-instruct"} <= set(cards(premium))
        assert "big-premium" not in cards(http) and MODEL in cards(http)  # pro: not on the entry's plans
        assert http.get("/v1/models/big-premium").status_code == 404
        assert set(cards(free)) == {"smollm2-135m-instruct"}  # the free plan's allowed_models
        assert free.get(f"/v1/models/{MODEL}").status_code == 404


def test_the_admin_cli_adds_an_entry_with_its_parsers_and_trust(cstack: Stack, admin: httpx.Client) -> None:
    cstack.env.update({"FLATFARE_ADMIN_URL": cstack.base_url, "FLATFARE_ADMIN_TOKEN": cstack.admin_token})  # type: ignore[attr-defined]
    added = cstack.cli("admin", "models", "add", "kimi-cli", "--source", "moonshotai/Kimi-K2-Instruct",
                       "--option", "tool_call_parser=kimi_k2", "--option", "enable_auto_tool_choice=true",
                       "--option", 'limit_mm_per_prompt={"image": 0}', "--trust-remote-code")
    assert added.returncode == 0, added.stderr
    entry = admin.get("/models/kimi-cli").json()
    assert entry["trust_remote_code"] is True and entry["capabilities"]["auto_tool_choice"] is True
    assert entry["engine_options"]["limit_mm_per_prompt"] == {"image": 0} and not entry["capabilities"]["vision"]
    refused = cstack.cli("admin", "models", "add", "bad-cli", "--source", "x", "--option", "trust_remote_code=true")
    assert refused.returncode != 0 and "engine_options.trust_remote_code" in refused.stderr, refused.stderr
