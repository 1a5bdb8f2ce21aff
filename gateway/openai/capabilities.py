"""A request that needs what its model does not offer is refused here, before anything is counted.

The capabilities come from the model's catalog entry (:mod:`flatfare.capabilities`): without this
check such a request would reach the engine and come back as vLLM's own 400 naming a command-line
flag the caller has never seen ("requires --enable-auto-tool-choice"), after a quota unit was
counted. A model outside the catalog (a worker started with ``--source``) is not described, so
nothing is checked for it.
"""

from __future__ import annotations

from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.media import media_refs
from flatfare.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from flatfare.gateway.jobpath.pools import CatalogEntry
from flatfare.gateway.responses.protocol import ResponsesRequest

CODE = "unsupported_capability"
_MEDIA = {"image": "image input (vision)", "audio": "audio input", "video": "video input"}


def check_capabilities(parsed: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
                       entry: CatalogEntry | None, embeds: bool = False) -> None:
    """Raise the client's 400 naming the capability and the model, or return. ``embeds``: the request's
    kind is served by embedding models only (see :mod:`flatfare.gateway.openai.kinds`)."""
    if entry is None:
        return
    capabilities, model = entry.capabilities, parsed.model
    if embeds and not capabilities.embeddings:
        raise _lacks(model, "embeddings (it is not an embedding model)", "model",
                     "use a model whose capabilities include embeddings (GET /v1/models)")
    if not embeds and capabilities.embeddings:
        raise APIError(400, f"The model '{model}' is an embedding model: it serves POST /v1/embeddings only and "
                       "generates no text; use a model whose capability embeddings is false (GET /v1/models) for "
                       "chat and completions.", param="model", code=CODE)
    if not isinstance(parsed, (ChatCompletionRequest, ResponsesRequest)):
        return
    if parsed.tools and parsed.tool_choice != "none":
        if not capabilities.tools:
            raise _lacks(model, "function calling (tools)", "tools",
                         "send the request without tools (or with tool_choice 'none'), or use a model whose "
                         "capabilities include tools (GET /v1/models)")
        if parsed.tool_choice in (None, "auto") and not capabilities.auto_tool_choice:
            raise _lacks(model, "automatic tool choice (tool_choice 'auto', the default when tools are sent)",
                         "tool_choice", "set tool_choice to 'required' or to a named function")
    if isinstance(parsed, ResponsesRequest):  # text items only: its wire model refuses media
        return
    if any(type(message.content) is list for message in parsed.messages):
        for param, kind in _media(parsed):
            if not capabilities.accepts(kind):
                raise _lacks(model, _MEDIA[kind], param, "send text only, or use a model whose capabilities "
                             f"include {'vision' if kind == 'image' else kind} (GET /v1/models)")
    extra = parsed.model_extra or {}
    if extra.get("reasoning_effort") is not None and not capabilities.reasoning:
        raise _lacks(model, "reasoning", "reasoning_effort", "leave reasoning_effort out, or use a model whose "
                     "capabilities include reasoning (GET /v1/models)")


def _media(parsed: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(param, kind) of every media item: URLs, and OpenAI's inline ``input_audio`` parts."""
    found = [(ref.param, ref.kind) for ref in media_refs(parsed.messages)]
    for m, message in enumerate(parsed.messages):
        if isinstance(message.content, list):
            found += [(f"messages[{m}].content[{p}].input_audio", "audio") for p, part in enumerate(message.content)
                      if isinstance(part, dict) and part.get("input_audio") is not None]
    return found


def _lacks(model: str, what: str, param: str, then: str) -> APIError:
    return APIError(400, f"The model '{model}' does not support {what}; {then}.", param=param, code=CODE)
