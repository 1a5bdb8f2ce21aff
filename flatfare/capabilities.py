"""What a catalog entry's engine options promise through the API, and the names those options may use.

The gateway reads it to validate catalog entries (admin API), to list each model's capabilities
(``/v1/models``) and to refuse a request that needs one the model lacks, before anything is counted;
the worker reads it to find the file of a named chat template. It imports nothing of Flatfare's and
no vLLM: the gateway's hosts need not have vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's registered tool-call parsers (``--tool-call-parser``), as in vLLM 0.32, the CPU build:
# tests/workers/test_engine_options.py checks that the installed vLLM has every one.
TOOL_CALL_PARSERS = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
})
# vLLM's registered reasoning parsers (``--reasoning-parser``), as in vLLM 0.32.
REASONING_PARSERS = frozenset({
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon",
    "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3",
    "mistral", "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3",
    "step3p5",
})
# The media a prompt may carry besides text (vLLM's ``--limit-mm-per-prompt`` keys), by the name the
# API's capabilities use.
MODALITIES = {"image": "vision", "audio": "audio", "video": "video"}

# Chat templates shipped with Flatfare, named by their file's stem (``chatml-tools``). A catalog entry
# names one of these or gives an absolute path on the worker; never text, and never from a request.
CHAT_TEMPLATES_DIR = Path(__file__).parent / "chat_templates"


def chat_template_names() -> list[str]:
    return sorted(path.stem for path in CHAT_TEMPLATES_DIR.glob("*.jinja"))


def chat_template_path(value: str) -> str:
    """The file vLLM reads for a catalog entry's ``chat_template``: a shipped template's, or the
    absolute path as given. Raises ValueError, saying what is accepted, for anything else."""
    if value in chat_template_names():
        return str(CHAT_TEMPLATES_DIR / f"{value}.jinja")
    if value.startswith("/") and "\n" not in value and "{" not in value:
        return value
    raise ValueError(f"chat_template must name a template shipped with Flatfare ({', '.join(chat_template_names())}) "
                     "or be an absolute path to a .jinja file on the workers")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a model does through the API, as its catalog entry configures it."""

    # Function calling: a tool-call parser, so tool_choice "required" and a named function work.
    tools: bool = False
    # tool_choice "auto" (the default when tools are sent): the model decides, the parser reads its call.
    auto_tool_choice: bool = False
    # A reasoning parser: the model's thinking comes back apart, as ``reasoning_content``.
    reasoning: bool = False
    # Media per prompt ({"image": 4}); a modality absent or at 0 is refused.
    media: tuple[tuple[str, int], ...] = ()
    # An embedding model (vLLM's pooling runner): it answers /v1/embeddings and generates no text, so
    # chat and completions are refused on it, as embeddings are on every other model.
    embeddings: bool = False

    def accepts(self, modality: str) -> bool:
        return dict(self.media).get(modality, 0) > 0

    def public(self) -> dict[str, bool]:
        """The capabilities as ``/v1/models`` shows them. JSON mode and structured outputs (JSON
        schema, regex, choice, grammar) are the engine's own and work on every model that generates."""
        generates = not self.embeddings
        shown = {"tools": self.tools, "auto_tool_choice": self.auto_tool_choice, "json_mode": generates,
                 "structured_outputs": generates, "reasoning": self.reasoning}
        shown.update({name: self.accepts(modality) for modality, name in MODALITIES.items()})
        shown["embeddings"] = self.embeddings
        return shown


def capabilities_of(options: dict[str, Any]) -> Capabilities:
    """A catalog entry's capabilities, from its engine options (``vllm serve``'s names)."""
    limits = options.get("limit_mm_per_prompt") or {}
    media = tuple(sorted((k, int(v)) for k, v in limits.items() if isinstance(v, int) and k in MODALITIES))
    parser = bool(options.get("tool_call_parser"))
    return Capabilities(tools=parser, auto_tool_choice=parser and bool(options.get("enable_auto_tool_choice")),
                        reasoning=bool(options.get("reasoning_parser")), media=media, embeddings=embeds(options))


def embeds(options: dict[str, Any]) -> bool:
    """An entry vLLM serves as an embedding model: ``convert`` ``embed`` (a generative architecture
    turned into one), or the ``pooling`` runner without another conversion (a model that is one, such
    as a sentence-transformers folder)."""
    convert = options.get("convert")
    return convert == "embed" or (options.get("runner") == "pooling" and convert in (None, "auto"))
