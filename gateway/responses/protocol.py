"""The wire model of ``POST /v1/responses``: what the gateway refuses before anything is counted.

Like the chat and completion models it allows extra fields, which vLLM validates as ``vllm serve``
does. Input items are checked for what Flatfare serves on this endpoint: text, function calls and their
outputs, reasoning items. Items that make the engine fetch something (images, files) and OpenAI's
hosted tools (web search, file search, code interpreter, MCP) are refused naming the item.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flatfare.gateway.errors import invalid
from flatfare.gateway.openai import grammar_caps
from flatfare.gateway.openai.protocol import REFUSED_FIELDS

# Items one request may give the model, its earlier turns (previous_response_id) included: the plan's
# body size and input tokens bound their size, this their number (each is a message the template wraps).
MAX_INPUT_ITEMS = 2048
MAX_RESPONSE_ID = 64
# Item types a text model is given; "message" items may carry these content parts.
ITEM_TYPES = frozenset(("message", "function_call", "function_call_output", "reasoning"))
TEXT_PARTS = frozenset(("input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"))
# Not served here: Flatfare runs no tool server, so a hosted tool could not be called.
UNSUPPORTED = "Flatfare's Responses endpoint serves text, function tools and reasoning items"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: Annotated[str, Field(min_length=1, max_length=MAX_RESPONSE_ID)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    background: bool | None = None
    user: str | None = None

    def output_tokens(self) -> int | None:
        return self.max_output_tokens

    def items(self) -> list[dict[str, Any]]:
        """The input as items: a text input is one user message."""
        if type(self.input) is str:
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input  # type: ignore[return-value]

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        extra = self.model_extra
        if extra:
            for name in extra.keys() & {*REFUSED_FIELDS, "conversation", "prompt"}:
                if extra[name] is not None:
                    raise grammar_caps.refuse_field(name, REFUSED_FIELDS.get(
                        name, "stored conversations and prompt templates are OpenAI's; continue a conversation "
                        "with previous_response_id."))
        if self.background:
            raise grammar_caps.refuse_field("background", "responses run while the request waits; send it "
                                            "without background (or use the Batch API).")
        if type(self.input) is list:
            if len(self.input) > MAX_INPUT_ITEMS:
                raise invalid(f"input has {len(self.input)} items; at most {MAX_INPUT_ITEMS} are allowed.",
                              param="input", code="too_many_input_items")
            for i, item in enumerate(self.input):
                check_item(item, f"input[{i}]")
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise invalid(f"tools[{i}] is a {tool.get('type')!r} tool; {UNSUPPORTED}: give tools of type "
                              "'function'.", param=f"tools[{i}].type", code="unsupported_tool")
        if self.tools:
            grammar_caps.check_tools(self.tools)
        text_format = (self.text or {}).get("format")
        if isinstance(text_format, dict) and text_format.get("schema") is not None:
            grammar_caps.check_schema(text_format["schema"], "text.format.schema")
        return self


def check_item(item: dict[str, Any], param: str) -> None:
    """One input item: a type this endpoint serves, and text-only content."""
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise invalid(f"{param} is a {kind!r} item; {UNSUPPORTED} ({', '.join(sorted(ITEM_TYPES))}).",
                      param=f"{param}.type", code="unsupported_input_item")
    content = item.get("content")
    if kind != "message" or type(content) is not list:
        return
    for p, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            shown = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{param}.content[{p}] is a {shown!r} part; {UNSUPPORTED}: send text parts "
                          "(input_text), or images through /v1/chat/completions.",
                          param=f"{param}.content[{p}]", code="unsupported_input_item")


class ResponseObject(BaseModel):
    """The fields of a finished response the gateway reads (the rest passes through untouched)."""

    model_config = ConfigDict(extra="allow")

    id: str
    output: list[dict[str, Any]] = []
