"""The built-in models' table and the template the second one is served with (no engine, no preparing:
the e2e test tests/e2e/test_second_model.py prepares and serves both)."""

from __future__ import annotations

import ast
from pathlib import Path

import jinja2
import pytest

from flatfare.capabilities import chat_template_path
from flatfare.workers.prepare import BUILTIN_MODELS, GEMMA3, SMOLLM2, PrepareError, resolve_source

REPO = Path(__file__).resolve().parents[2]


def test_an_unknown_built_in_model_is_refused_naming_the_ones_there_are(tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match=f"{SMOLLM2}, {GEMMA3}"):
        resolve_source("builtin:llama-9000", tmp_path)
    assert not list(tmp_path.iterdir())


def test_every_built_in_model_is_seeded_by_a_migration_and_installed_by_install_sh() -> None:
    migrations = "".join(path.read_text() for path in (REPO / "migrations" / "versions").glob("0*.py"))
    install = (REPO / "scripts" / "install.sh").read_text()
    for name, model in BUILTIN_MODELS.items():
        assert f'"{name}"' in migrations, f"no migration seeds {name}"
        assert f"'{model.install}'" in install, model.install
        if model.assembled:
            for part in range(1, 5):
                assert model.install.replace("==", f"-part{part}==") in install
        if model.chat_template:
            chat_template_path(model.chat_template)  # a shipped template: raises otherwise


def render(**fields: object) -> str:
    return jinja2.Environment().from_string(open(chat_template_path("plain-tools")).read()).render(
        bos_token="<bos>", **fields)


def test_plain_tools_writes_plain_turns_and_ends_with_the_answer_prompt() -> None:
    text = render(add_generation_prompt=True, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": [{"type": "text", "text": "And Spain?"}]}])
    assert text == "<bos>Be brief.\n\nUser: What is the capital of France?\nAssistant: Paris.\nUser: And Spain?\nAssistant:"


def test_plain_tools_writes_calls_as_python_and_results_as_lines() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = render(tools=[tool], add_generation_prompt=True, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": True}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    assert '"name": "get_weather"' in text and "Python list" in text
    call = text.split("Assistant: ")[1].split("\n")[0]
    assert call == '[get_weather(city="Paris", days=2, metric=True)]'
    # What vLLM's pythonic parser reads: a Python list of calls with literal keyword arguments.
    (parsed,) = ast.parse(call).body[0].value.elts  # type: ignore[attr-defined]
    assert {kw.arg: ast.literal_eval(kw.value) for kw in parsed.keywords} == {"city": "Paris", "days": 2, "metric": True}
    assert text.endswith("Tool result: 18 C\nAssistant:")
