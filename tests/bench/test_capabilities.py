"""The random-weight models and templates `python -m bench capabilities` runs on the H200: their tokens,
config and R1 template are what vLLM's parsers and processors look up, checked here with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capabilities
from flatfare.workers.prepare import resolve_source
from tests.conftest import MODELS_DIR


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return Path(resolve_source("builtin:smollm2-135m-instruct", MODELS_DIR))


@pytest.mark.parametrize("arch", ["qwen3", "llava"])
def test_a_made_model_names_the_tokens_its_parsers_need(arch: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    made = capabilities.make_model(arch, "tiny", tokenizer_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) <= config["vocab_size"]
    for token, token_id in made["added_tokens"].items():
        # One id each: vLLM's hermes and R1 parsers look the tokens up by id, LLaVA replaces <image> by id.
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    if arch == "llava":
        assert config["image_token_index"] == made["added_tokens"][capabilities.IMAGE]
        assert json.loads((tmp_path / "preprocessor_config.json").read_text())["crop_size"]["height"] == \
            config["vision_config"]["image_size"]


def test_the_r1_template_opens_thinking_only_where_the_answer_starts(tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    capabilities.make_model("qwen3", "tiny", tokenizer_dir, tmp_path)
    capabilities.write_r1_template(tmp_path)
    template = (tmp_path / "r1_chat_template.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "and now?"}]
    prompt = tokenizer.apply_chat_template(history, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert prompt.count("<think>") == 1  # the assistant turn of the history is not touched
    without = tokenizer.apply_chat_template(history, chat_template=template, tokenize=False)
    assert "<think>" not in without


def test_the_whitespace_bias_covers_only_whitespace(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    bias = capabilities.whitespace_tokens(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert bias and len(bias) <= 300  # the gateway's logit_bias cap
    assert all(tokenizer.decode([int(i)]).strip() == "" for i in bias)
    assert str(tokenizer.encode(" ", add_special_tokens=False)[0]) in bias
    assert str(tokenizer.encode("{", add_special_tokens=False)[0]) not in bias
