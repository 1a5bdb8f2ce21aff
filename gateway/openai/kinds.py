"""The gateway's side of each job kind (:class:`~flatfare.contract.Endpoint`): one row per kind.

A row names the kind's wire model, the plan caps on its work, the checks of its input against the
routed model, whether it needs an embedding model or one that generates, the field a plan's output
cap fills in, and, for a kind that needs more than the common path, its ``turn``: a hook that works
on the parsed request before its checks and on the answer's events (the Responses API expands a
stored conversation, then echoes and stores its result). :mod:`flatfare.gateway.openai.admission`
runs every kind through the same checks, and :class:`~flatfare.gateway.openai.service.CompletionService`
through the same path (admission, queue, ledger, relay), reading only this table; the worker's side
is ``flatfare.workers.engine.SERVING``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from pydantic import BaseModel, ValidationError

from flatfare.billing.plans import PlanRules
from flatfare.contract import Endpoint, Reply
from flatfare.gateway.errors import APIError, invalid, validation_error
from flatfare.gateway.openai.checks import check_fits, check_generation_caps
from flatfare.gateway.openai.embeddings import check_embedding_caps, check_embedding_input
from flatfare.gateway.openai.prompt_length import TokenCounter, check_prompt_length
from flatfare.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from flatfare.gateway.jobpath.pools import Pool
from flatfare.gateway.responses.checks import check_response_caps, check_response_input
from flatfare.gateway.responses.protocol import ResponsesRequest
from flatfare.gateway.responses.store import ResponseStore
from flatfare.gateway.responses.turn import ResponseTurn

OpenAIRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest | ResponsesRequest


class Turn(Protocol):
    """A kind's own part of one request's answer, on parsed data and events (never bytes or headers):
    what a whole answer's body becomes, and each reply of a stream as the SSE bytes the client gets."""

    # What the kind added to the client's body (earlier turns of a conversation), for the plan's body cap.
    added_bytes: int

    async def whole(self, request_id: str, response: dict[str, Any]) -> dict[str, Any]: ...

    async def event(self, request_id: str, reply: Reply) -> bytes: ...


# (the request's body, parsed; the account; where earlier turns are kept, None where none may be read:
# a batch line) -> the turn. It may edit the body in place: the admission reads it again after.
TurnHook = Callable[[dict[str, Any], Any, int, ResponseStore | None], Awaitable[Turn]]


@dataclass(frozen=True, slots=True)
class JobKind:
    endpoint: Endpoint
    wire: type[BaseModel]
    # The plan's caps on one request's work (sequences, output tokens, inputs), before anything is counted.
    check_caps: Callable[[Any, PlanRules], None]
    # The request's input against the routed model's context and the plan's input tokens.
    check_input: Callable[[Any, PlanRules, Pool, TokenCounter | None], Awaitable[None]]
    # True: served by embedding models only (capability ``embeddings``); False: by models that generate.
    embeds: bool
    # The body field a plan's output cap fills in when the request sets no limit; None: no text output.
    output_param: str | None
    # What the route does, for /docs.
    summary: str
    # Called on the parsed request before its checks; None: the common path is all the kind needs.
    turn: TurnHook | None = None


async def _check_generation_input(parsed: ChatCompletionRequest | CompletionRequest, plan: PlanRules, pool: Pool,
                                  counter: TokenCounter | None) -> None:
    check_fits(parsed, pool)
    await check_prompt_length(parsed, plan, counter)


KINDS: dict[Endpoint, JobKind] = {
    Endpoint.CHAT: JobKind(Endpoint.CHAT, ChatCompletionRequest, check_generation_caps, _check_generation_input,
                           embeds=False, output_param="max_completion_tokens",
                           summary="Creates a model response for the given chat conversation (OpenAI's API)."),
    Endpoint.COMPLETION: JobKind(Endpoint.COMPLETION, CompletionRequest, check_generation_caps,
                                 _check_generation_input, embeds=False, output_param="max_tokens",
                                 summary="Creates a completion for the provided prompt (OpenAI's API)."),
    Endpoint.EMBEDDINGS: JobKind(Endpoint.EMBEDDINGS, EmbeddingRequest, check_embedding_caps, check_embedding_input,
                                 embeds=True, output_param=None,
                                 summary="Creates embedding vectors of the input texts or token ids (OpenAI's API); "
                                 "one request is one unit, its inputs bounded by the plan."),
    # The Responses API's conversation is expanded before the checks and its answer echoed and stored
    # (flatfare.gateway.responses.turn): the worker gets the whole conversation, with store off.
    Endpoint.RESPONSES: JobKind(Endpoint.RESPONSES, ResponsesRequest, check_response_caps, check_response_input,
                                embeds=False, output_param="max_output_tokens",
                                summary="Creates a model response (OpenAI's Responses API): text or input items, "
                                "function tools, structured output, streamed events; store keeps it for "
                                "GET /v1/responses/{id}, previous_response_id continues it.",
                                turn=ResponseTurn.begin),
}


def parse_body(endpoint: Endpoint, raw: bytes) -> tuple[dict[str, Any], OpenAIRequest]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "We could not parse the JSON body of your request. Send a JSON object "
                       "with 'Content-Type: application/json'.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return body, validated(endpoint, body)


def validated(endpoint: Endpoint, body: dict[str, Any]) -> OpenAIRequest:
    """``body`` read by the kind's wire model (400 naming the first bad field)."""
    try:
        return KINDS[endpoint].wire.model_validate(body)  # type: ignore[return-value]
    except ValidationError as exc:
        raise validation_error(list(exc.errors()), body) from None
