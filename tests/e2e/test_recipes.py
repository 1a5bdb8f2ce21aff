"""README's GPU recipes are real catalog entries: each JSON block of "Adding a hub model on a GPU host"
goes through the admin API, each CLI line beside it makes the same entry, and ``/v1/models`` shows the
capabilities README names above the block. Read from README itself, so what users copy cannot drift from
what was checked. On the instant engine: nothing here serves these models (that needs the hub and GPUs)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Stack, eventually, launch_admin_stack

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = ("#### Adding a hub model on a GPU host", "#### What is proven, on which model")
# README's words for the capabilities /v1/models shows; JSON mode and structured outputs are every model's.
WORDS = {"tools": "tools", "automatic tool choice": "auto_tool_choice", "reasoning": "reasoning",
         "vision": "vision", "audio": "audio", "video": "video"}
ALWAYS = {"json_mode", "structured_outputs"}


@dataclass(frozen=True)
class Recipe:
    title: str
    capabilities: frozenset[str]  # as README names them above the blocks
    body: dict[str, Any]  # the admin API's JSON block
    cli: list[str]  # the `flatfare admin models add ...` line, split as a shell would

    @property
    def name(self) -> str:
        return str(self.body["name"])


def readme_recipes(text: str) -> list[Recipe]:
    """Each bold headline ("**Model**, where: capabilities.") with the ```json and ```bash blocks after it."""
    start, end = text.index(SECTION[0]), text.index(SECTION[1])
    recipes: list[Recipe] = []
    parts = re.split(r"^\*\*(.+?)\*\*, [^:\n]+: ([a-z ,]+)\.", text[start:end], flags=re.M)
    for title, named, rest in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        blocks = dict(re.findall(r"^```(json|bash)\n(.*?)^```", rest, flags=re.M | re.S))
        assert set(blocks) == {"json", "bash"}, f"{title}: a ```json and a ```bash block, got {sorted(blocks)}"
        words = [w.strip() for w in named.split(",")]
        assert all(w in WORDS for w in words), f"{title}: capabilities {words}, README's words are {sorted(WORDS)}"
        recipes.append(Recipe(title, frozenset(WORDS[w] for w in words), json.loads(blocks["json"]),
                              shlex.split(blocks["bash"])))
    return recipes


RECIPES = readme_recipes(README.read_text())


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_admin_stack(tmp_path_factory.mktemp("recipes"), "recipes") as stack:
        stack.env.update({"FLATFARE_ADMIN_URL": stack.base_url,
                          "FLATFARE_ADMIN_TOKEN": stack.admin_token})  # type: ignore[attr-defined]
        yield stack


@pytest.fixture(scope="module")
def admin(rstack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{rstack.base_url}/admin/v1", timeout=30,
                      headers={"Authorization": f"Bearer {rstack.admin_token}"}) as client:  # type: ignore[attr-defined]
        yield client


@pytest.fixture(scope="module")
def http(rstack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rstack.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {rstack.api_key}"}) as client:  # the pro plan
        yield client


def test_readme_shows_the_models_the_issue_names() -> None:
    sources = {r.body["source"] for r in RECIPES}
    assert {"meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B"} <= sources, sources
    assert len({r.name for r in RECIPES}) == len(RECIPES)
    for recipe in RECIPES:
        assert recipe.cli[:5] == ["flatfare", "admin", "models", "add", recipe.name], recipe.cli


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_a_readme_recipe_is_accepted_and_listed_with_its_capabilities(rstack: Stack, admin: httpx.Client,
                                                                      http: httpx.Client, recipe: Recipe) -> None:
    created = admin.post("/models", json=recipe.body)
    assert created.status_code == 201, created.text
    entry = created.json()
    assert entry["source"] == recipe.body["source"]
    assert entry["engine_options"] == recipe.body["engine_options"], entry  # kept as written, nothing dropped
    assert entry["trust_remote_code"] is bool(recipe.body.get("trust_remote_code"))
    shown = {name for name, on in entry["capabilities"].items() if on}
    assert shown == recipe.capabilities | ALWAYS, f"{recipe.title}: README says {sorted(recipe.capabilities)}"

    # The CLI line beside it, under another name, makes the same entry.
    twin = f"{recipe.name}-cli"
    added = rstack.cli(*recipe.cli[1:4], twin, *recipe.cli[5:])
    assert added.returncode == 0, added.stderr
    made = admin.get(f"/models/{twin}").json()
    for field in ("source", "engine_options", "trust_remote_code", "capabilities"):
        assert made[field] == entry[field], (field, made[field], entry[field])

    # Callers see it with those capabilities once a worker serves it, or at once when pinned (no worker
    # here: unavailable, with the catalog's context length).
    pinned = admin.patch(f"/models/{recipe.name}", json={"pinned": True})
    assert pinned.status_code == 200, pinned.text
    def card() -> dict[str, Any] | None:
        listed = http.get("/v1/models")
        assert listed.status_code == 200, listed.text
        return {c["id"]: c for c in listed.json()["data"]}.get(recipe.name)

    listed = eventually(card, lambda c: c is not None, f"{recipe.name} on /v1/models")
    assert listed["capabilities"] == entry["capabilities"]
    assert listed["state"] == "unavailable"
    assert listed["context_length"] == recipe.body["engine_options"].get("max_model_len")
    assert http.get(f"/v1/models/{recipe.name}").json() == listed


def test_a_misspelt_parser_is_refused_naming_it(admin: httpx.Client) -> None:
    (qwen,) = [r for r in RECIPES if r.body["source"] == "Qwen/Qwen3-8B"]
    body = {**qwen.body, "name": "qwen-typo",
            "engine_options": {**qwen.body["engine_options"], "reasoning_parser": "qwen_3"}}
    refused = admin.post("/models", json=body)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "engine_options.reasoning_parser" and "qwen_3" in error["message"], error
    assert admin.get("/models/qwen-typo").status_code == 404


def test_trust_remote_code_is_the_entrys_own_switch_and_turning_it_off_is_audited(admin: httpx.Client) -> None:
    trusting = [r for r in RECIPES if r.body.get("trust_remote_code")]
    assert trusting, "README shows an entry with trust_remote_code (Kimi K2)"
    recipe = trusting[0]
    name = f"{recipe.name}-trust"
    created = admin.post("/models", json={**recipe.body, "name": name})
    assert created.status_code == 201 and created.json()["trust_remote_code"] is True, created.text
    assert "trust_remote_code" not in created.json()["engine_options"]
    as_option = admin.post("/models", json={"name": f"{name}-opt", "source": recipe.body["source"],
                                            "engine_options": {"trust_remote_code": True}})
    assert as_option.status_code == 422, as_option.text
    assert as_option.json()["error"]["param"] == "engine_options.trust_remote_code"
    turned_off = admin.patch(f"/models/{name}", json={"trust_remote_code": False})
    assert turned_off.status_code == 200 and turned_off.json()["trust_remote_code"] is False, turned_off.text
    audit = admin.get("/audit", params={"resource_type": "model", "resource_id": name}).json()["data"]
    assert audit[0]["before"]["engine_options"]["trust_remote_code"] is True
    assert "trust_remote_code" not in audit[0]["after"]["engine_options"]


def test_vllms_own_parser_takes_each_recipe_as_the_worker_passes_it() -> None:
    """The arguments a worker builds from each entry, parsed by the installed vLLM's ``vllm serve`` parser
    (the worker's own): no flag it does not know, each value where vLLM reads it, parsers it has
    registered (its argument parser leaves those to the server's start)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from flatfare.workers.engine import _first_attr, engine_argv

    make_arg_parser = _first_attr([("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
                                   ("vllm.entrypoints.openai.cli_args", "make_arg_parser")])
    parser = make_arg_parser(FlexibleArgumentParser(prog="flatfare worker"))
    for recipe in RECIPES:
        options = {**recipe.body["engine_options"], "trust_remote_code": bool(recipe.body.get("trust_remote_code"))}
        args = parser.parse_args(engine_argv(recipe.body["source"], recipe.name, options))
        assert args.model == recipe.body["source"] and args.trust_remote_code is options["trust_remote_code"]
        for option, value in recipe.body["engine_options"].items():
            assert getattr(args, option) == value, (recipe.name, option, getattr(args, option), value)
        assert args.tool_call_parser in {None, *ToolParserManager.list_registered()}, recipe.name
        assert args.reasoning_parser in {None, "", *ReasoningParserManager.list_registered()}, recipe.name
