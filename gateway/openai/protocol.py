"""Wire models that validate OpenAI request bodies before anything is queued.

They check what the gateway must refuse early (shapes, types, ranges, and what would cost the
engine far more than the request's size: see :mod:`flatfare.gateway.openai.grammar_caps` and :mod:`flatfare.gateway.openai.media`) and
allow extra fields, which go to the engine untouched: vLLM validates those exactly as ``vllm serve``
does. Those checks raise :class:`~flatfare.gateway.errors.APIError` naming the parameter, which pydantic
lets through unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flatfare.gateway.openai import grammar_caps, media
from flatfare.gateway.errors import invalid

MAX_N = 128
# OpenAI's bounds: best_of up to 20, 20 log probabilities per token, 300 biased tokens.
MAX_BEST_OF = 20
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
# OpenAI's bound, and vLLM 0.32's (VLLM_MAX_STOP_STRINGS): 5 to 16 reached the engine and got its 400.
MAX_STOP = 4
MAX_STOP_CHARS = 512
_Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
_Stop = _StopText | Annotated[list[_StopText], Field(max_length=MAX_STOP)]

# Fields vLLM accepts that a platform serving strangers does not: each changes what the engine loads
# or runs beyond the request's own tokens (vLLM 0.32 refuses the first three by default too; older
# engines may not).
REFUSED_FIELDS = {
    "chat_template": "the model's own chat template is always used.",
    "mm_processor_kwargs": "multimodal processing options are set by the platform.",
    "media_io_kwargs": "media loading options are set by the platform.",
    "prompt_embeds": "send text or token ids; embeddings are not accepted.",
    "kv_transfer_params": "KV-cache transfer is internal to the platform.",
    "ec_transfer_params": "encoder-cache transfer is internal to the platform.",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class Message(_Body):
    role: _Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Sampling(_Body):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    seed: int | None = None
    stop: _Stop | None = None
    user: str | None = None
    # vLLM extensions, bounded like OpenAI's own parameters.
    best_of: Annotated[int, Field(ge=1, le=MAX_BEST_OF)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    structured_outputs: dict[str, Any] | None = None

    def output_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> int:
        """How many prompts the request carries (a completion may send a list)."""
        return 1

    def sequences(self) -> int:
        """The sequences the engine generates for this request: prompts x n, or x best_of when larger.
        This is the request's work, and what the plan's ``max_n`` caps."""
        return self.prompts() * max(self.n or 1, self.best_of or 1)

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        # Most requests carry none of these: the checks cost them two attribute reads.
        extra = self.model_extra
        if extra:
            for name in extra.keys() & REFUSED_FIELDS.keys():
                if extra[name] is not None:
                    raise grammar_caps.refuse_field(name, REFUSED_FIELDS[name])
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise invalid(f"best_of ({self.best_of}) must be at least n ({self.n}).", param="best_of")
        if extra or self.structured_outputs is not None or getattr(self, "response_format", None) is not None:
            grammar_caps.check_constraints(dict(self))  # declared and extra fields alike
        self._check_content()
        return self

    def _check_content(self) -> None:
        """What the endpoint's own fields must pass (tools, media)."""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _check_content(self) -> None:
        if self.tools:
            grammar_caps.check_tools(self.tools)
        if any(type(message.content) is list for message in self.messages):  # text-only: nothing to fetch
            for ref in media.media_refs(self.messages):
                media.check_media(ref)


_Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: _Prompt
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    def prompts(self) -> int:
        prompt = self.prompt
        if type(prompt) is str or (prompt and type(prompt[0]) is int):
            return 1  # one text, or one prompt as token ids
        return len(prompt)  # a list of texts or of token-id lists

    def _check_content(self) -> None:
        if type(self.prompt) is list and not self.prompt:
            raise invalid("prompt must not be an empty list.", param="prompt")


_Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: texts or token-id lists to embed. Each input is one sequence the engine
    pools; the plan bounds how many one request may carry (see :mod:`flatfare.gateway.openai.embeddings`)."""

    model: Annotated[str, Field(min_length=1, max_length=256)]
    input: _Input
    encoding_format: Literal["float", "base64"] | None = None
    # Matryoshka embeddings: only a model that declares them may shorten its vectors (vLLM checks that).
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    @property
    def stream(self) -> bool:
        """Embeddings come back whole (the ledger's ``stream`` column)."""
        return False

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, one entry each: texts, or token-id lists."""
        given = self.input
        if type(given) is str:
            return [given]
        if given and type(given[0]) is int:
            return [given]  # type: ignore[list-item]  # one input as token ids
        return given  # type: ignore[return-value]

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        extra = self.model_extra
        if extra:
            for name in extra.keys() & REFUSED_FIELDS.keys():
                if extra[name] is not None:
                    raise grammar_caps.refuse_field(name, REFUSED_FIELDS[name])
        if type(self.input) is list and (not self.input or any(type(i) is list and not i for i in self.input)):
            raise invalid("input must not be empty, nor hold an empty list of token ids.", param="input")
        if any(type(i) is str and not i for i in self.inputs()):
            raise invalid("input must not hold an empty string: each text is embedded as it is.", param="input")
        return self
