"""LoRA variants (issue 22 item 4) on the real vLLM CPU engine (its CPU build runs LoRA through
PunicaWrapperCPU): catalog entries whose base_model is SmolLM2 are served by SmolLM2's worker under
their own names. Adapters of SmolLM2-135M's real shape (r=8 on q_proj and v_proj, random weights) are
written by the test: at temperature 0 a variant with a nonzero lora_B answers differently from the base
model, one whose lora_B is zero answers exactly as the base; a variant added to the catalog after the
worker started is loaded when a request first names it; a disabled one is not served; one whose adapter
the engine refuses (a rank over max_lora_rank) fails its request with 503 and the worker serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flatfare.contract import ReplyKind
from flatfare.workers.prepare import resolve_source
from tests.conftest import MODELS_DIR
from tests.e2e.real_worker import MODEL, RealWorker, real_worker, sql

pytestmark = pytest.mark.e2e

LORA_OPTIONS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "enforce_eager": True}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def write_adapter(folder: Path, *, seed: int, zero_b: bool = False, rank: int = 8) -> Path:
    """A PEFT LoRA adapter for SmolLM2-135M (shapes read from its config.json) on q_proj and v_proj."""
    import torch
    from safetensors.torch import save_file

    # Prepared here if no worker prepared it yet (the worker then finds it ready).
    model = Path(resolve_source(f"builtin:{MODEL}", MODELS_DIR))
    config = json.loads((model / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out, rank) if zero_b else \
                torch.randn(out, rank, generator=generator) * 0.1
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(outputs), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": MODEL}))
    return folder


def add_variant(database_url: str, name: str, adapter: Path, *, enabled: bool = True) -> None:
    sql(database_url, "INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers, base_model) "
        "VALUES (:name, :source, '{}', :enabled, false, 0, :base)", name=name, source=str(adapter),
        enabled=enabled, base=MODEL)


@pytest.fixture(scope="module")
def lora_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealWorker, str, Path]]:
    data = tmp_path_factory.mktemp("lora")
    adapters = data / "adapters"
    write_adapter(adapters / "random", seed=1)
    write_adapter(adapters / "zero", seed=2, zero_b=True)
    write_adapter(adapters / "late", seed=3)
    write_adapter(adapters / "wide", seed=4, rank=16)  # over the engine's max_lora_rank
    urls: list[str] = []

    def variants(database_url: str) -> None:
        urls.append(database_url)
        add_variant(database_url, "smol-random", adapters / "random")
        add_variant(database_url, "smol-zero", adapters / "zero")
        add_variant(database_url, "smol-off", adapters / "random", enabled=False)

    with real_worker(data / "worker", engine_options=LORA_OPTIONS, before_start=variants) as worker:
        yield worker, urls[0], adapters


def answer(worker: RealWorker, model: str) -> str:
    reply = worker.ask({"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 16})
    assert (reply.kind, reply.status) == (ReplyKind.RESPONSE, 200), reply.data
    body = json.loads(reply.data)
    assert body["model"] == model  # answered under the variant's own name
    return body["choices"][0]["message"]["content"]


def test_a_variant_answers_differently_and_a_zero_adapter_as_the_base(lora_worker) -> None:
    worker, _, _ = lora_worker
    assert "loaded the LoRA variant smol-random" in worker.log.read_text()  # at start, from the catalog
    # Not "Paris" asked of the base: with LoRA on (and enforce_eager) SmolLM2-135M's greedy answer depends on
    # the CPU's kernels (one machine: "Paris", another: "L'Étoile, la Marseillaise, ..."); what holds everywhere
    # is that the base answers, a random adapter changes the answer and a zero one does not.
    base = answer(worker, MODEL)
    assert base.strip()
    assert answer(worker, "smol-random") != base
    assert answer(worker, "smol-zero") == base
    assert answer(worker, MODEL) == base  # the variants leave the base model as it was


def test_a_variant_added_after_the_start_is_loaded_when_first_asked_for(lora_worker) -> None:
    worker, database_url, adapters = lora_worker
    add_variant(database_url, "smol-late", adapters / "late")
    late = answer(worker, "smol-late")
    assert late != answer(worker, MODEL)
    assert answer(worker, "smol-late") == late  # loaded once, served again as it was


def test_a_disabled_or_unknown_variant_is_not_served(lora_worker) -> None:
    worker, _, _ = lora_worker
    for name in ("smol-off", "no-such-variant"):
        reply = worker.ask({"model": name, "messages": QUESTION, "max_tokens": 4})
        assert (reply.kind, reply.status) == (ReplyKind.ERROR, 404), reply.data
        assert name in json.loads(reply.data)["error"]["message"]


def test_an_adapter_the_engine_refuses_fails_the_request_cleanly(lora_worker) -> None:
    worker, database_url, adapters = lora_worker
    before = answer(worker, MODEL)
    add_variant(database_url, "smol-wide", adapters / "wide")
    reply = worker.ask({"model": "smol-wide", "messages": QUESTION, "max_tokens": 4})
    assert (reply.kind, reply.status) == (ReplyKind.ERROR, 503), reply.data
    error = json.loads(reply.data)["error"]
    assert error["code"] == "model_unavailable" and "smol-wide" in error["message"]
    assert answer(worker, MODEL) == before  # the worker serves on, as before
