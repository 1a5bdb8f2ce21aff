"""Catalog engine options become the same arguments `vllm serve` takes."""

from __future__ import annotations

from flatfare.workers.engine import engine_argv


def test_options_become_flags() -> None:
    argv = engine_argv("/models/m", "m", {"max_model_len": 4096, "enforce_eager": True, "enable_prefix_caching": False,
                                           "tensor_parallel_size": 2, "load_format": "dummy",
                                           "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    assert argv[:4] == ["--model", "/models/m", "--served-model-name", "m"]
    joined = " ".join(argv)
    assert "--max-model-len 4096" in joined and "--enforce-eager" in joined
    assert "--tensor-parallel-size 2" in joined and "--load-format dummy" in joined
    assert "--no-enable-prefix-caching" in joined
    assert '--speculative-config {"method": "ngram", "num_speculative_tokens": 3}' in joined


def test_tensor_parallel_needs_as_many_visible_gpus() -> None:
    import pytest

    from flatfare.workers.engine import EngineError, check_gpus, gpus_needed

    assert gpus_needed({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}) == 8
    check_gpus({"tensor_parallel_size": 2}, visible=2)
    check_gpus({}, visible=0)  # one engine on the CPU or one GPU: nothing to check
    with pytest.raises(EngineError, match="needs 4 GPUs, but 2 are visible"):
        check_gpus({"tensor_parallel_size": 4}, visible=2)


def test_a_worker_asked_for_more_gpus_than_it_sees_refuses_to_start(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from flatfare.storage.db import migrate

    database = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(database)
    env = {**os.environ, "FLATFARE_DATABASE_URL": database, "FLATFARE_REDIS_URL": "redis://127.0.0.1:1/0",
           "FLATFARE_DATA_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "flatfare", "worker", "--engine-options",
                           '{"tensor_parallel_size": 2}'], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs 2 GPUs, but 0 are visible" in done.stderr
