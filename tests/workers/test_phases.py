"""The start phases a worker reads from vLLM's log: real lines of vLLM 0.32 on the CPU (SmolLM2) and
0.26 on the H200 (1B shape) map to the phase they start; the logging configuration handed to vLLM
still applies and also writes vLLM's records to the phase file, and stops once the worker removed it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flatfare.logs import dict_config
from flatfare.workers.phases import vllm_phase, with_phase_log

LINES = [
    ("Initializing a V1 LLM engine (v0.32.0) with config: model='/root/.flatfare/models/smollm2'", None),
    ("Starting to load model /root/.flatfare/models/smollm2-135m-instruct...", "loading weights"),
    ("Loading weights took 0.81 seconds", "loading weights"),
    ("Warming up model for the compilation...", "compiling for the CPU"),
    ("Dynamo bytecode transform time: 4.61 s", "compiling the model"),
    ("Compiling a graph for compile range (1, 8192) takes 9.80 s", "compiling the model"),
    ("Available KV cache memory: 60.71 GiB", "warming up"),
    ("CPU KV cache size: 46,592 tokens, Maximum concurrency for 8,192 tokens per request: 5.69x", "warming up"),
    ("Graph capturing finished in 4 secs, took 0.49 GiB", "capturing graphs"),
    ("init engine (profile, create kv cache, warmup model) took 3.16 s", "warming up"),
    ("Using max model len 8192", None),
]


@pytest.mark.parametrize(("line", "phase"), LINES)
def test_vllm_lines_map_to_their_phase(line: str, phase: str | None) -> None:
    assert vllm_phase(line) == phase


def test_the_phase_file_gets_vllm_records_until_the_worker_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.touch()
    config = with_phase_log(dict_config("info", "json"), path)
    assert config["loggers"]["vllm"]["handlers"] == ["flatfare", "phase"]  # vLLM's own output stays
    # As an engine process applies it (vLLM's VLLM_LOGGING_CONFIG_PATH): in a process of its own, so this
    # one's logging stays as pytest set it.
    script = f"""
import json, logging, logging.config, pathlib
logging.config.dictConfig(json.loads({json.dumps(json.dumps(config))}))
path = pathlib.Path({str(path)!r})
vllm = logging.getLogger("vllm.v1.worker")
vllm.info("Starting to load model %s...", "m")
logging.getLogger("flatfare.worker").info("not vLLM's")
assert path.read_text() == "Starting to load model m...\\n", path.read_text()
path.unlink()
vllm.info("Loading weights took 0.8 seconds")
assert not path.exists()  # not made again: the engine's processes outlive the start
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
