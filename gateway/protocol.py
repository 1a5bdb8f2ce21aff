"""Wire models that validate OpenAI request bodies before anything is queued.

They check what the gateway must refuse early (shapes, types, ranges) and allow extra fields,
which go to the engine untouched: vLLM validates those exactly as ``vllm serve`` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
_Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_Stop = str | Annotated[list[str], Field(max_length=16)]


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

    def output_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


_Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: _Prompt
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
