"""Catalog engine options become the same arguments `vllm serve` takes."""

from __future__ import annotations

from workers.engine import engine_argv


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
