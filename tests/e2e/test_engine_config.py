"""The engine's effective configuration is visible (issue 20, item 7): the worker of the shared real
stack logs the vLLM configuration it started with, and the admin API's model state shows it per worker,
so an operator sees that the catalog's options (and the worker's own) took effect."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import Stack, eventually

pytestmark = pytest.mark.e2e

# The seeded catalog entry's options (migrations 0001 and 0006); SmolLM2's own context is 8192.
CATALOG = {"max_model_len": 2048, "dtype": "float32", "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
           "tool_strict_level": "parameter", "chat_template": "chatml-tools.jinja"}
# The stack's worker options (tests/conftest.py) and every worker's own (workers/main.py).
WORKER = {"enforce_eager": True, "scheduling_policy": "priority"}


def _workers(stack: Stack, token: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{stack.base_url}/admin/v1/models/{stack.model}", timeout=30,
                         headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.text
    return response.json()["workers"]


def test_the_admin_api_shows_the_catalog_options_the_engine_started_with(stack: Stack) -> None:
    token = stack.cli("admin", "bootstrap", "--name", "engine-config", "--force")
    assert token.returncode == 0, token.stderr
    workers = eventually(lambda: _workers(stack, token.stdout.strip()),
                         lambda ws: any(w["engine_config"] for w in ws), "a worker announcing its engine config")
    config = next(w for w in workers if w["engine_config"])["engine_config"]
    assert {k: config.get(k) for k in {**CATALOG, **WORKER}} == {**CATALOG, **WORKER}
    # Resolved by vLLM, not written anywhere in the catalog: it is read back from the running engine.
    assert config["max_num_seqs"] > 0 and config["max_num_batched_tokens"] > 0
    assert config["vllm_version"] and config["enable_prefix_caching"] in (True, False)
    assert json.dumps(config).isascii() and len(json.dumps(config)) < 2000  # small: it rides every heartbeat


def test_the_worker_logs_one_line_with_its_engine_config(stack: Stack) -> None:
    lines = [json.loads(line) for line in (stack.logs / "worker.log").read_text().splitlines()
             if line.startswith("{") and "engine_config" in line]
    started = [line for line in lines if line.get("logger") == "flatfare.worker" and "engine_config" in line]
    assert len(started) == 1, lines
    assert {k: started[0]["engine_config"].get(k) for k in CATALOG} == CATALOG
