"""Flatfare's worker keeps logging after vLLM's imports (on the GPU, vLLM 0.26's API server module imports
model_hosting_container_standards, which sets the root logger and its handlers to ERROR: no worker or engine
line was written after "start: starting the engine"). vLLM 0.32 imports it only when building its own app,
and applies its logging configuration again when it creates the engine's configuration: this test
makes the import happen where 0.26 does (right after the API-server module Flatfare imports) and, as 0.26,
nothing applies the configuration again. It needs no model: the engine fails to start after every import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import asyncio, importlib, importlib.abc, importlib.machinery, logging, sys
from flatfare.logs import configure_logging, dict_config
from flatfare.workers.engine import Engine

API_SERVERS = {"vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.openai.api_server"}

class AsIn026(importlib.abc.MetaPathFinder):
    """vllm/entrypoints/openai/api_server.py:35 -> serve/sagemaker/api_router.py:8 in vLLM 0.26."""
    def find_spec(self, name, path, target=None):
        if name not in API_SERVERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                importlib.import_module("model_hosting_container_standards.sagemaker")
                # 0.32 applies its logging configuration again in create_engine_config (and AsyncLLM),
                # which hides the change; 0.26 does not.
                for owner in ("vllm.engine.arg_utils", "vllm.v1.engine.async_llm"):
                    owner = sys.modules.get(owner)
                    if owner is not None and hasattr(owner, "configure_logging_if_needed"):
                        owner.configure_logging_if_needed = lambda config: None
            spec.loader.exec_module = exec_module
        return spec

configure_logging("info", "json")
sys.meta_path.insert(0, AsIn026())
engine = Engine(["--model", sys.argv[1]], logging_config=dict_config("info", "json"), engine_metrics=False)
try:
    asyncio.run(engine.start())
except Exception as exc:
    logging.getLogger("flatfare.worker").info("after the engine's start: %s", type(exc).__name__)
else:
    logging.getLogger("flatfare.worker").info("after the engine's start")
    engine.shutdown()
'''


def test_the_worker_still_logs_after_an_import_of_vllm_raised_the_root_level(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()  # no model: the engine fails to start, after every vLLM import
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("after the engine's start") for line in lines), done.stderr[-3000:]
