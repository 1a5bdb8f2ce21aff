"""Catalog entries as the admin API validates them: every option of the README's GPU recipes passes,
unknown and contradictory ones are refused naming them, and trust_remote_code only as the entry's own switch."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from flatfare.capabilities import capabilities_of
from flatfare.gateway.admin.catalog_schemas import ModelCreate, ModelUpdate

# Example entries (README's own GPU recipes are read from README and sent through the admin API by
# tests/e2e/test_recipes.py).
RECIPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"source": "meta-llama/Llama-3.1-8B-Instruct", "engine_options": {
        "max_model_len": 32768, "tool_call_parser": "llama3_json", "enable_auto_tool_choice": True}},
    "qwen3-8b": {"source": "Qwen/Qwen3-8B", "engine_options": {
        "tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3"}},
    "deepseek-r1": {"source": "deepseek-ai/DeepSeek-R1-0528", "engine_options": {
        "tensor_parallel_size": 8, "reasoning_parser": "deepseek_r1", "enable_expert_parallel": True}},
    "kimi-k2": {"source": "moonshotai/Kimi-K2-Instruct", "trust_remote_code": True, "engine_options": {
        "tensor_parallel_size": 8, "tool_call_parser": "kimi_k2", "enable_auto_tool_choice": True}},
    "gemma-3-27b": {"source": "google/gemma-3-27b-it", "engine_options": {
        "dtype": "bfloat16", "limit_mm_per_prompt": {"image": 4},
        "allowed_media_domains": ["upload.wikimedia.org"]}},
    "smollm2-135m-instruct": {"source": "builtin:smollm2-135m-instruct", "engine_options": {
        "dtype": "float32", "max_model_len": 2048, "tool_call_parser": "hermes", "enable_auto_tool_choice": True,
        "tool_strict_level": "parameter", "chat_template": "chatml-tools"}},
    "traced": {"source": "builtin:smollm2-135m-instruct", "engine_options": {
        "otlp_traces_endpoint": "http://otel-collector.observability:4317"}},
}


def refusal(body: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        ModelCreate.model_validate({"name": "m", "source": "x", **body})
    first = caught.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_readme_recipes_validate(name: str) -> None:
    entry = ModelCreate.model_validate({"name": name, **RECIPES[name]})
    options = entry.options()
    assert options.get("trust_remote_code", False) is bool(RECIPES[name].get("trust_remote_code"))


def test_capabilities_follow_the_options() -> None:
    def caps(name: str) -> dict[str, bool]:
        return capabilities_of(ModelCreate.model_validate({"name": name, **RECIPES[name]}).options()).public()

    assert caps("llama-3.1-8b") == {"tools": True, "auto_tool_choice": True, "json_mode": True,
                                         "structured_outputs": True, "reasoning": False, "vision": False,
                                         "audio": False, "video": False, "embeddings": False}
    assert caps("qwen3-8b")["reasoning"] and caps("deepseek-r1")["reasoning"] and not caps("deepseek-r1")["tools"]
    assert caps("gemma-3-27b")["vision"] and not caps("gemma-3-27b")["tools"]
    assert not capabilities_of({"limit_mm_per_prompt": {"image": 0}}).public()["vision"]
    assert capabilities_of({"tool_call_parser": "hermes"}).public()["auto_tool_choice"] is False


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"engine_options": {"tool_call_parser": "hermes2"}}, "engine_options.tool_call_parser", "unknown tool_call_parser"),
    ({"engine_options": {"reasoning_parser": "r1"}}, "engine_options.reasoning_parser", "unknown reasoning_parser"),
    ({"engine_options": {"chat_template": "llama9"}}, "engine_options.chat_template", "chatml-tools"),
    ({"engine_options": {"chat_template": "{% for m in messages %}{% endfor %}"}}, "engine_options.chat_template",
     "absolute path"),
    ({"engine_options": {"chat_template": "templates/mine.jinja"}}, "engine_options.chat_template", "absolute path"),
    ({"engine_options": {"enable_auto_tool_choice": True}}, "engine_options", "needs tool_call_parser"),
    ({"engine_options": {"tool_strict_level": "parameter"}}, "engine_options", "only applies with a tool_call_parser"),
    ({"engine_options": {"tool_call_parser": "hermes", "tool_strict_level": "strict"}},
     "engine_options.tool_strict_level", "'auto', 'function' or 'parameter'"),
    ({"engine_options": {"limit_mm_per_prompt": {"smell": 1}}}, "engine_options.limit_mm_per_prompt.smell", "Extra"),
    ({"engine_options": {"limit_mm_per_prompt": {"image": 65}}}, "engine_options.limit_mm_per_prompt.image", "64"),
    ({"engine_options": {"allowed_media_domains": ["upload.wikimedia.org"]}}, "engine_options",
     "limit_mm_per_prompt"),
    ({"engine_options": {"limit_mm_per_prompt": {"image": 1}, "allowed_media_domains": ["https://x.org/a"]}},
     "engine_options.allowed_media_domains.0", "pattern"),
    ({"engine_options": {"tokenizer_mode": "mistral", "config_format": "hf"}}, "engine_options", "disagree"),
    ({"engine_options": {"quantization": "gguf", "load_format": "safetensors"}}, "engine_options", "contradicts"),
    ({"engine_options": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}}},
     "engine_options.speculative_config", "needs speculative_config.model"),
    ({"engine_options": {"trust_remote_code": True}}, "engine_options.trust_remote_code",
     "catalog entry's own"),
    ({"engine_options": {"allowed_local_media_path": "/"}}, "engine_options.allowed_local_media_path", "Extra"),
    ({"engine_options": {"tool_parser_plugin": "/tmp/evil.py"}}, "engine_options.tool_parser_plugin", "Extra"),
    ({"trust_remote_code": None}, "trust_remote_code", "cannot be null"),
    ({"engine_options": {"otlp_traces_endpoint": "collector:4317 --model /etc"}}, "engine_options.otlp_traces_endpoint",
     "pattern"),
])
def test_unknown_and_conflicting_options_are_refused_naming_them(body: dict[str, Any], param: str, words: str) -> None:
    where, message = refusal(body)
    assert where == param and words in message, (where, message)


def test_trust_remote_code_is_kept_across_edits_until_turned_off() -> None:
    current = {"tensor_parallel_size": 8, "trust_remote_code": True}
    assert ModelUpdate.model_validate({"engine_options": {"tensor_parallel_size": 4}}).options(current) == \
        {"tensor_parallel_size": 4, "trust_remote_code": True}
    assert ModelUpdate.model_validate({"trust_remote_code": False}).options(current) == {"tensor_parallel_size": 8}
    assert ModelUpdate.model_validate({"trust_remote_code": True}).options({"dtype": "auto"}) == \
        {"dtype": "auto", "trust_remote_code": True}
