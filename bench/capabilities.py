"""Capabilities on real architectures: tools, reasoning and vision through Flatfare, set by catalog entries.

No reasoning or vision model small enough ships on PyPI, so this proves the *format* on random weights of a
real architecture (the lent H200 for real shapes; tiny shapes run on the CPU too):

* ``make-model``: a random-weight model folder (config + tokenizer, weights filled by vLLM's
  ``load_format: dummy``) of one of :data:`ARCHS`, with the SmolLM2 tokenizer plus the special tokens the
  architecture's parsers and processor need (``<think>``, ``<tool_call>``, ``<image>``).
* ``run``: a Flatfare stack (private Redis, SQLite, one worker, one gateway) whose model comes from a
  catalog entry validated by the admin API's own :class:`EngineOptions`, then the SDK checks of
  :func:`check` through the whole path, written to a JSON file.

What each check can and cannot show on random weights is in :data:`CHECKS` (and the report).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.procs import services
from bench.stack import FlatfareStack

# Special tokens added to the SmolLM2 tokenizer: what vLLM's hermes tool parser and R1 reasoning parser look
# up by id (they refuse a tokenizer without them), and LLaVA's image placeholder.
THINK = ["<think>", "</think>"]
TOOL_CALL = ["<tool_call>", "</tool_call>"]
IMAGE = "<image>"
VOCAB = 49280  # SmolLM2's 49,152 plus the added tokens, rounded up to a multiple of 64

# The real shapes (Qwen3-8B; LLaVA-1.5-7B: Llama-2-7B with CLIP ViT-L/14-336) and tiny ones for the CPU.
QWEN3 = {
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}
LLAVA_TEXT = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4),
}
LLAVA_VISION = {
    "7b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
               image_size=336, patch_size=14, projection_dim=768),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 image_size=56, patch_size=14, projection_dim=64),
}
# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT:"), images first as in its processor.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% elif message['role'] == 'assistant' %}ASSISTANT: {{ message['content'] }}</s>\n"
    "{% else %}{{ message['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# DeepSeek R1's way of starting an answer: the generation prompt opens the thinking block, so everything the
# model writes until </think> is reasoning.
R1_OPEN = "{{- '<think>\\n' -}}"

ARCHS = ("qwen3", "llava")

CHECKS = {
    # Two entries of one random Qwen3: "thinking" (hermes + deepseek_r1 behind an R1 template) and "tools"
    # (hermes alone). A reasoning parser holds structured output back until </think>, which random weights
    # never write (a real thinking model does), so forced calls and schemas are checked on "tools". There
    # every whitespace token gets logit_bias -100: the grammars allow any whitespace between JSON tokens and
    # random weights fill max_tokens with it; the answer's JSON is still the grammar's.
    "tools_required": "tool_choice required: a call to the only tool whose arguments parse as JSON (vLLM "
                      "constrains forced calls with the tools' schema, so this holds on random weights)",
    "tools_named": "a named function: a call to that function with JSON arguments",
    "tools_auto": "tool_choice auto with the hermes parser: a well-formed answer, text or parsed calls "
                  "(random weights rarely write <tool_call>)",
    "tools_streamed": "required, streamed: the call's name and argument deltas assemble into JSON",
    "tool_result_turn": "the follow-up turn with a tool message is accepted and answered",
    "json_schema": "response_format json_schema: the content parses and has the schema's required key",
    "reasoning": "reasoning parser deepseek_r1 behind an R1-style template: the text comes back in the "
                 "message's reasoning field, not in content (random weights never close </think>)",
    "reasoning_streamed": "the same streamed: reasoning deltas, no content deltas",
    "vision": "a data-URL PNG in an image_url part: answered, and its prompt counts the image's tokens "
              "(prompt_tokens above the same prompt without the image by at least the patches)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make-model", help="a random-weight model folder (config + tokenizer)")
    make.add_argument("--arch", choices=ARCHS, required=True)
    make.add_argument("--size", default="tiny", help="qwen3: 8b|tiny; llava: 7b|tiny")
    make.add_argument("--tokenizer", type=Path, required=True, help="the SmolLM2 tokenizer's folder")
    make.add_argument("--out", type=Path, required=True)
    run = sub.add_parser("run", help="a Flatfare stack on a catalog entry, then the SDK checks")
    run.add_argument("--model-dir", type=Path, required=True)
    run.add_argument("--entry", choices=ENTRIES, required=True)
    run.add_argument("--name", default="")
    run.add_argument("--engine-options", default="{}", help="JSON merged over the architecture's catalog entry")
    run.add_argument("--workdir", type=Path, default=Path("/tmp/ffcaps"))
    run.add_argument("--json", type=Path, required=True)
    run.add_argument("--ready-timeout", type=float, default=600)
    rep = sub.add_parser("report", help="the JSON files of `run` (or a caps.tgz's folder) as one Markdown table")
    rep.add_argument("paths", type=Path, nargs="+")
    rep.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "capabilities_gpu.md")


def make_model(arch: str, size: str, tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    added = THINK + TOOL_CALL if arch == "qwen3" else [IMAGE]
    tokenizer.add_special_tokens({"additional_special_tokens": added})
    if arch == "llava":
        tokenizer.chat_template = LLAVA_TEMPLATE
    assert len(tokenizer) <= VOCAB, len(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in added}
    common = dict(vocab_size=VOCAB, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  torch_dtype="bfloat16", dtype="bfloat16")
    if arch == "qwen3":
        config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=8192,
                      rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, hidden_act="silu",
                      attention_bias=False, **QWEN3[size], **common)
    else:
        vision = LLAVA_VISION[size]
        config = dict(
            architectures=["LlavaForConditionalGeneration"], model_type="llava", image_token_index=ids[IMAGE],
            image_token_id=ids[IMAGE],
            projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
            image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2,
            text_config=dict(model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=4096,
                             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
                             **LLAVA_TEXT[size], **common),
            vision_config=dict(model_type="clip_vision_model", hidden_act="quick_gelu", layer_norm_eps=1e-5,
                               num_channels=3, **vision),
            **common)
        # CLIP's preprocessing at the vision tower's size, as llava-1.5's processor does it.
        side = vision["image_size"]
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "crop_size": {"height": side, "width": side}, "size": {"shortest_edge": side},
            "do_center_crop": True, "do_resize": True, "do_normalize": True, "do_rescale": True,
            "do_convert_rgb": True, "rescale_factor": 1 / 255, "resample": 3,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
        (out / "processor_config.json").write_text(json.dumps({
            "processor_class": "LlavaProcessor", "patch_size": vision["patch_size"],
            "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
            "image_token": IMAGE}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    made = {"arch": arch, "size": size, "out": str(out), "added_tokens": ids}
    print(json.dumps(made), flush=True)
    return made


# The catalog entries checked, each on its own stack: (architecture, engine options, checks).
ENTRIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "qwen3-thinking": ("qwen3", {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                 "reasoning_parser": "deepseek_r1"},
                       ("reasoning", "reasoning_streamed", "tools_auto", "tool_result_turn")),
    "qwen3-tools": ("qwen3", {"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                              "chat_template": "chatml-tools"},
                    ("tools_required", "tools_named", "tools_streamed", "json_schema")),
    "llava": ("llava", {"limit_mm_per_prompt": {"image": 1}}, ("vision",)),
}


def catalog_entry(entry: str, model_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """The catalog entry's engine options: what a real model of its architecture is served with."""
    options = dict(ENTRIES[entry][1])
    if options.get("reasoning_parser"):
        options["chat_template"] = str(model_dir / "r1_chat_template.jinja")
    return {"load_format": "dummy", "max_model_len": 4096, **options, **extra}


def write_r1_template(model_dir: Path) -> None:
    """Flatfare's shipped ``chatml-tools`` template (Hermes-style tools) with R1's open thinking block."""
    from flatfare.capabilities import chat_template_path

    text = Path(chat_template_path("chatml-tools")).read_text()
    # Only the generation prompt (the template's last assistant header), not the assistant turns of history.
    marker = "<|im_start|>assistant\\n"
    at = text.index("}}", text.rindex(marker)) + 2
    text = text[:at] + R1_OPEN + text[at:]
    (model_dir / "r1_chat_template.jinja").write_text(text)


def png_data_url(side: int = 64) -> str:
    from PIL import Image

    image = Image.new("RGB", (side, side), (200, 30, 30))
    for x in range(side // 2):
        image.putpixel((x, x), (20, 20, 220))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# strict: the arguments follow the schema (OpenAI's switch; vLLM 0.32 constrains a forced call's envelope
# only, unless the tool is strict or the entry's tool_strict_level says "parameter").
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}


def _call_ok(call: Any) -> bool:
    try:
        return call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    except (TypeError, ValueError):
        return False


def whitespace_tokens(model_dir: Path) -> dict[str, int]:
    """logit_bias pushing every whitespace-only token away (see the note above :data:`CHECKS`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    return {str(i): -100 for i in ids}


def check(base_url: str, key: str, model: str, checks: tuple[str, ...], model_dir: Path) -> dict[str, dict[str, Any]]:
    """Each check's outcome: ok, and what was seen."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=300)
    results: dict[str, dict[str, Any]] = {}

    def record(name: str, ok: bool, seen: Any) -> None:
        results[name] = {"ok": bool(ok), "seen": seen, "what": CHECKS[name]}
        print(f"[capabilities] {name}: {'ok' if ok else 'FAILED'} {json.dumps(seen)[:300]}", flush=True)

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failed check is a result, not the end of the run
            record(name, False, f"{exc.__class__.__name__}: {exc}"[:600])

    constrained = {"tools_required", "tools_named", "tools_streamed", "json_schema"}  # the grammar-bound checks
    flat = whitespace_tokens(model_dir) if constrained & set(checks) else {}
    def required() -> None:
        answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=64, temperature=0, logit_bias=flat)
        calls = answer.choices[0].message.tool_calls or []
        record("tools_required", len(calls) >= 1 and all(map(_call_ok, calls)),
               [c.function.model_dump() for c in calls])

    def named() -> None:
        answer = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, logit_bias=flat)
        calls = answer.choices[0].message.tool_calls or []
        record("tools_named", len(calls) == 1 and _call_ok(calls[0]), [c.function.model_dump() for c in calls])

    def auto() -> None:
        answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=32,
                                                temperature=0, logit_bias=flat)
        choice = answer.choices[0]
        calls = choice.message.tool_calls or []
        well_formed = all(map(_call_ok, calls)) and choice.finish_reason in ("stop", "length", "tool_calls")
        record("tools_auto", well_formed, {"finish_reason": choice.finish_reason, "calls": len(calls),
                                           "content": (choice.message.content or "")[:80]})

    def streamed() -> None:
        stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=64, temperature=0, stream=True, logit_bias=flat)
        calls: dict[int, dict[str, str]] = {}
        for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""

        def parses(text: str) -> bool:
            try:
                return isinstance(json.loads(text), dict)
            except ValueError:
                return False

        record("tools_streamed", bool(calls) and all(c["name"] == "get_weather" and parses(c["arguments"])
                                                     for c in calls.values()), list(calls.values()))

    def result_turn() -> None:
        answer = client.chat.completions.create(model=model, messages=[
            *ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}],
            tools=TOOLS, max_tokens=16, temperature=0, logit_bias=flat)
        record("tool_result_turn", answer.choices[0].finish_reason in ("stop", "length", "tool_calls"),
               {"finish_reason": answer.choices[0].finish_reason})

    def json_schema() -> None:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a city as JSON."}], max_tokens=96,
            temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": SCHEMA, "strict": True}}, logit_bias=flat)
        message = answer.choices[0].message
        content = message.content
        try:
            ok = content is not None and "city" in json.loads(content)
        except ValueError:
            ok = False
        record("json_schema", ok, {"content": content, "reasoning": (_reasoning(message) or "")[:60]})

    def reasoning() -> None:
        answer = client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "Think first: what is 2 + 2?"}], max_tokens=24, temperature=0)
        message = answer.choices[0].message
        thought = _reasoning(message)
        record("reasoning", bool(thought) and not message.content,
               {"reasoning": (thought or "")[:80], "content": message.content})

    def reasoning_streamed() -> None:
        stream = client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "Think first: what is 2 + 2?"}], max_tokens=24, temperature=0,
            stream=True)
        thought, content = "", ""
        for chunk in stream:
            if chunk.choices:
                thought += _reasoning(chunk.choices[0].delta) or ""
                content += chunk.choices[0].delta.content or ""
        record("reasoning_streamed", bool(thought) and not content, {"reasoning": thought[:80],
                                                                      "content": content[:80]})

    def vision() -> None:
        text = [{"type": "text", "text": "What colour is this image?"}]
        plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                               max_tokens=8, temperature=0)
        seen = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url()}}, *text]}], max_tokens=8, temperature=0)
        extra = seen.usage.prompt_tokens - plain.usage.prompt_tokens
        record("vision", extra >= 4 and seen.choices[0].finish_reason in ("stop", "length"),
               {"prompt_tokens_without": plain.usage.prompt_tokens, "prompt_tokens_with": seen.usage.prompt_tokens,
                "content": seen.choices[0].message.content})

    found = {"tools_required": required, "tools_named": named, "tools_auto": auto, "tools_streamed": streamed,
             "tool_result_turn": result_turn, "reasoning": reasoning, "reasoning_streamed": reasoning_streamed,
             "json_schema": json_schema, "vision": vision}
    for name in checks:
        attempt(name, found[name])
    return results


def _reasoning(message: Any) -> str | None:
    """vLLM names the field ``reasoning`` (0.26 on) and once named it ``reasoning_content``."""
    extra = getattr(message, "model_extra", None) or {}
    return extra.get("reasoning") or extra.get("reasoning_content") or getattr(message, "reasoning", None)


def write_report(paths: list[Path], out: Path) -> None:
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.glob("*.json")))
    lines = ["# Capabilities through Flatfare on real architectures (random weights)", "",
             "`python -m bench capabilities` via `bench/gpu_device.sh capabilities` on the lent H200 (vLLM 0.26): "
             "a Flatfare stack per catalog entry (the entry validated by the admin API's EngineOptions; the worker "
             "reads it from the catalog), then the `openai` SDK through the whole path. Random weights prove the "
             "formats and the wiring (parsers, templates, constraints), not answer quality.", ""]
    for f in files:
        data = json.loads(f.read_text())
        lines += [f"## {data['model']} ({data['arch']})", "", f"Catalog entry: `{json.dumps(data['catalog_entry'])}`",
                  "", "| check | result | what it shows | seen |", "| --- | --- | --- | --- |"]
        for name, result in data.get("checks", {}).items():
            seen = json.dumps(result["seen"])[:120].replace("|", "\\|")
            lines.append(f"| {name} | {'ok' if result['ok'] else 'FAILED'} | {result['what']} | `{seen}` |")
        lines.append("")
    out.write_text("\n".join(lines))
    print(f"[capabilities] wrote {out}")


def run(args: argparse.Namespace) -> int:
    if args.action == "report":
        write_report(args.paths, args.out)
        return 0
    if args.action == "make-model":
        make_model(args.arch, args.size, args.tokenizer, args.out)
        return 0
    arch, entry_options, checks = ENTRIES[args.entry]
    name = args.name or f"{args.entry}-random"
    if entry_options.get("reasoning_parser"):  # catalog_entry points the entry at this template
        write_r1_template(args.model_dir)
    options = catalog_entry(args.entry, args.model_dir, json.loads(args.engine_options))
    report: dict[str, Any] = {"model": name, "entry": args.entry, "arch": arch, "model_dir": str(args.model_dir)}
    started = time.monotonic()
    with services() as group:
        stack = FlatfareStack(group, args.workdir, name, [])
        try:
            stack.start_storage()
            report["catalog_entry"] = stack.add_catalog_entry(name, str(args.model_dir), options)
            report["worker_ready_s"] = round(stack.start_worker(args.ready_timeout), 1)
            stack.start_gateway(args.ready_timeout)
            report["checks"] = check(stack.base_url, stack.key, name, checks, args.model_dir)
        finally:
            stack.stop()
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    failed = [k for k, v in report.get("checks", {}).items() if not v["ok"]]
    print(f"[capabilities] {name}: {len(report.get('checks', {})) - len(failed)} ok, failed: {failed or 'none'}")
    return 1 if failed or not report.get("checks") else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
