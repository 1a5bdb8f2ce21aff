"""The vLLM engine options a catalog entry may set, validated before any worker starts with them.

Names are ``vllm serve``'s. Each field is one an operator needs for a real model's recipe (Llama 3.x,
Qwen3, DeepSeek R1, Kimi K2, Gemma 3): its tool-call and reasoning parsers, its chat template, its
media limits, its parallelism and speed options. Unknown options, unknown parser or template names and
options that contradict each other are refused (422 naming them), so a bad entry fails in the admin
API instead of in a worker's start. ``trust_remote_code`` is not one of them: it is the entry's own
top-level switch (see :mod:`flatfare.gateway.admin.schemas`), so it is never set by accident.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flatfare.capabilities import REASONING_PARSERS, TOOL_CALL_PARSERS, chat_template_path

# A host name as vLLM's --allowed-media-domains compares it (no scheme, port or path).
_Domain = Annotated[str, Field(min_length=1, max_length=253,
                               pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")]
# A collector's URL: scheme, host[:port], an optional path; nothing a shell or vLLM's parser would split.
_OTLP_ENDPOINT = r"^https?://[A-Za-z0-9._\[\]:-]+(/[\w./-]*)?$"
_PerPrompt = Annotated[int, Field(ge=0, le=64)]
_Scalar = bool | int | float | str


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeConfig(_In):
    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"]
    num_speculative_tokens: Annotated[int, Field(ge=1, le=16)]
    model: str | None = None
    prompt_lookup_max: Annotated[int, Field(ge=1)] | None = None
    prompt_lookup_min: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.method '{self.method}' needs speculative_config.model "
                             "(the draft or EAGLE head's folder or hub id)")
        if self.method != "ngram" and (self.prompt_lookup_max or self.prompt_lookup_min):
            raise ValueError("speculative_config.prompt_lookup_max and prompt_lookup_min are for method 'ngram' only")
        if self.prompt_lookup_min and self.prompt_lookup_max and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min is larger than prompt_lookup_max")
        return self


class MediaLimits(_In):
    """Items of each kind one prompt may carry (vLLM's --limit-mm-per-prompt). A kind absent or at 0
    is refused by the gateway before anything is counted; a text-only model sets none."""

    image: _PerPrompt | None = None
    audio: _PerPrompt | None = None
    video: _PerPrompt | None = None


class EngineOptions(_In):
    """The vLLM engine options a catalog entry may set (``vllm serve``'s names)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    # An embedding model: vLLM's pooling runner (a sentence-transformers folder), or a generative
    # architecture converted to embed; the entry then serves /v1/embeddings only (flatfare.capabilities).
    runner: Literal["auto", "generate", "pooling"] | None = None
    convert: Literal["auto", "none", "embed"] | None = None
    max_model_len: Annotated[int, Field(ge=16)] | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] | None = None
    pipeline_parallel_size: Annotated[int, Field(ge=1, le=64)] | None = None
    enable_expert_parallel: bool | None = None
    quantization: Literal["awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "compressed-tensors",
                          "bitsandbytes", "gguf", "mxfp4", "modelopt"] | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=16)] | None = None
    speculative_config: SpeculativeConfig | None = None
    cpu_offload_gb: Annotated[float, Field(ge=0)] | None = None
    load_format: Literal["auto", "safetensors", "pt", "dummy", "gguf", "mistral"] | None = None
    enforce_eager: bool | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    # The model's files: a revision of a hub model, another tokenizer, Mistral's own formats.
    revision: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._/-]+$")] | None = None
    tokenizer: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    tokenizer_mode: Literal["auto", "slow", "mistral"] | None = None
    config_format: Literal["auto", "hf", "mistral"] | None = None
    # "vllm": ignore the model's generation_config.json (its default temperature, top_p, ...).
    generation_config: Literal["auto", "vllm"] | None = None
    # Function calling: the parser that reads the model's calls back; auto lets the model decide.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool | None = None
    exclude_tools_when_tool_choice_none: bool | None = None
    # How far vLLM (0.32 on) constrains calls to the tools' schemas: "function" the call's envelope
    # for every request with tools, "parameter" its arguments too (as if every tool were strict), so
    # even a small model's calls parse. "auto": only forced calls, and arguments of strict tools.
    tool_strict_level: Literal["auto", "function", "parameter"] | None = None
    # Thinking models (DeepSeek R1, Qwen3, Kimi K2 Thinking): their reasoning comes back apart.
    reasoning_parser: str | None = None
    # A template shipped with Flatfare (by name) or an absolute path on the workers; never a request's.
    chat_template: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    chat_template_content_format: Literal["auto", "openai", "string"] | None = None
    # Defaults for the template's switches, e.g. {"enable_thinking": false} for a Qwen3 sold without thinking.
    default_chat_template_kwargs: Annotated[dict[Annotated[str, Field(max_length=64)], _Scalar],
                                            Field(max_length=16)] | None = None
    # Multimodal models: media per prompt, and the only hosts their URLs may name.
    limit_mm_per_prompt: MediaLimits | None = None
    allowed_media_domains: Annotated[list[_Domain], Field(min_length=1, max_length=64)] | None = None
    mm_processor_cache_gb: Annotated[float, Field(ge=0, le=1024)] | None = None
    # LoRA: a base model whose catalog variants (entries with base_model) its engines serve. max_loras
    # adapters run in one batch, max_cpu_loras stay loaded in host memory (at least max_loras).
    enable_lora: bool | None = None
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = None
    max_loras: Annotated[int, Field(ge=1, le=256)] | None = None
    max_cpu_loras: Annotated[int, Field(ge=1, le=4096)] | None = None
    # vLLM's own OTLP trace export: the collector its engine sends spans to (OTLP over gRPC unless the
    # worker's OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is http/protobuf). Each request's spans continue the
    # trace its job carries (flatfare.tracecontext); docs/OPERATIONS.md says how to follow one.
    otlp_traces_endpoint: Annotated[str, Field(min_length=1, max_length=512, pattern=_OTLP_ENDPOINT)] | None = None
    # Refused here: the entry's own trust_remote_code field turns it on (see the module's docstring).
    trust_remote_code: bool | None = None

    @field_validator("trust_remote_code")
    @classmethod
    def _not_here(cls, value: bool | None) -> None:
        raise ValueError("trust_remote_code is not an engine option here: set the catalog entry's own "
                         "\"trust_remote_code\": true to let this model's repository run its code in the workers")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; vLLM's are: {', '.join(sorted(TOOL_CALL_PARSERS))}")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {value!r}; vLLM's are: {', '.join(sorted(REASONING_PARSERS))}")
        return value

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            chat_template_path(value)  # its ValueError says what is accepted
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: name the parser for the model's "
                             "tool-call format (e.g. 'hermes', 'llama3_json')")
        for option in ("exclude_tools_when_tool_choice_none", "tool_strict_level"):
            if getattr(self, option) and not self.tool_call_parser:
                raise ValueError(f"{option} only applies with a tool_call_parser")
        if self.allowed_media_domains and not self._accepts_media():
            raise ValueError("allowed_media_domains is set but limit_mm_per_prompt accepts no media: set "
                             "limit_mm_per_prompt (e.g. {\"image\": 4}) for a multimodal model")
        if self.quantization == "gguf" and self.load_format not in (None, "gguf"):
            raise ValueError(f"quantization 'gguf' loads a GGUF file: load_format '{self.load_format}' contradicts it")
        for option in ("max_lora_rank", "max_loras", "max_cpu_loras"):
            if getattr(self, option) is not None and not self.enable_lora:
                raise ValueError(f"{option} only applies with enable_lora: true")
        if self.max_cpu_loras is not None and self.max_cpu_loras < (self.max_loras or 1):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras or 1}): the adapters a batch runs are also kept in host memory")
        formats = {self.tokenizer_mode, self.config_format} - {None, "auto"}
        if "mistral" in formats and len(formats) > 1:
            raise ValueError("tokenizer_mode and config_format disagree: a Mistral-format model sets both to "
                             "'mistral' (and load_format 'mistral')")
        return self

    def _accepts_media(self) -> bool:
        limits = self.limit_mm_per_prompt
        return limits is not None and any(v for v in limits.model_dump().values())

    def as_options(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
