"""What makes a request admissible: the one step every way in takes before anything is counted,
queued or written.

(endpoint, body, caller) -> an :class:`Admissible` request, or one refusal: the client's
:class:`~flatfare.gateway.errors.APIError`, with one set of codes whichever way the request came.
The ways in: the job kinds' routes (chat, completions, embeddings, Responses) and the console's
playground, through :class:`~flatfare.gateway.openai.service.CompletionService`, and each line of a
batch, through the batch dispatcher (:mod:`flatfare.gateway.batches.dispatcher`), which records a
refusal as the line's error, free.

The checks, in order: the body against its kind's wire model; a kind's own ``turn`` (the Responses
API expands a stored conversation); the plan's caps (body size, models, the request's work:
sequences, output tokens, inputs); the API key's own models; the request screen (media hosts that
resolve to private addresses, the account's new output grammars a minute); the model's catalog
entry, read once: the capabilities the request needs, the plans it is offered on; the route to a
pool; the input against the routed model's context and the plan's input tokens (only a long prompt
waits for a tokenizer). The body the job carries then loses the fields only the platform sets and
gets the plan's output cap, within the model's context, where it sets no limit of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from flatfare.billing.plans import AccountTerms
from flatfare.contract import Endpoint
from flatfare.gateway.auth import Caller
from flatfare.gateway.errors import APIError
from flatfare.gateway.openai.capabilities import check_capabilities
from flatfare.gateway.openai.checks import check_caps, check_key_allows
from flatfare.gateway.openai.kinds import KINDS, JobKind, OpenAIRequest, Turn, parse_body, validated
from flatfare.gateway.openai.prompt_length import TokenCounter
from flatfare.gateway.openai.screen import RequestScreen
from flatfare.gateway.jobpath.pools import Pool, Pools
from flatfare.gateway.responses.store import ResponseStore

# Fields only the platform sets: the engine's request id and scheduling priority.
RESERVED_FIELDS = ("request_id", "priority")


@dataclass(slots=True)
class Admissible:
    """A request that passed every check: what its job carries and where it goes."""

    endpoint: Endpoint
    kind: JobKind
    # The job's body: the client's, with the reserved fields dropped and the plan's output cap filled in.
    body: dict[str, Any]
    parsed: OpenAIRequest
    terms: AccountTerms
    pool: Pool
    # The kind's own part of the answer (None: the common path is all it needs).
    turn: Turn | None = None

    def job_body(self) -> str:
        return orjson.dumps(self.body).decode()


def _no_label(**_values: str) -> None:
    pass


class Admission:
    def __init__(self, pools: Pools, screen: RequestScreen | None = None, tokenizers: TokenCounter | None = None,
                 conversations: ResponseStore | None = None) -> None:
        self._pools = pools
        # Image hosts that resolve to private addresses; grammar floods (None: not screened, in unit tests).
        self._screen = screen
        self._tokenizers = tokenizers
        # Where a Responses request's earlier turns are read and its answer kept.
        self._conversations = conversations

    async def check(self, endpoint: Endpoint, raw: bytes, caller: Caller, terms: AccountTerms, *,
                    batch_line: bool = False, label: Callable[..., None] = _no_label) -> Admissible:
        """The request admissible as ``caller`` on ``terms`` (the account's plan now), or the APIError
        that refuses it. ``batch_line``: a line of a batch, which waits for its pool's engines rather
        than being refused while none can come up, and reads no stored conversation. ``label`` hears
        the routed model (the metrics' and the log line's label)."""
        kind = KINDS[endpoint]
        body, parsed = parse_body(endpoint, raw)
        turn = None
        size = len(raw)
        if kind.turn is not None:
            turn = await kind.turn(body, parsed, caller.account_id, None if batch_line else self._conversations)
            parsed = validated(endpoint, body)
            size += turn.added_bytes
        check_caps(parsed, terms, size, kind.check_caps)
        check_key_allows(parsed, caller.key)
        if self._screen is not None:
            await self._screen.check(caller.account_id, parsed)
        entry = (await self._pools.catalog()).get(parsed.model)
        check_capabilities(parsed, entry, kind.embeds)  # tools, media, reasoning, embeddings the model lacks: 400
        if entry is not None and not entry.allows_plan(terms.plan.name):
            raise APIError(403, f"The model '{parsed.model}' is not offered on the {terms.plan.name} plan.",
                           param="model", code="model_not_allowed")
        pool = await self._pools.route(parsed.model, terms.pool, entry=entry, wait=batch_line)
        label(model=pool.model)
        # The model's context and the plan's input cap: only a long prompt waits for a tokenizer.
        await kind.check_input(parsed, terms.plan, pool, self._tokenizers)
        for name in RESERVED_FIELDS:
            body.pop(name, None)
        cap = terms.plan.max_output_tokens
        if cap is not None and kind.output_param is not None and parsed.output_tokens() is None:
            # Without a limit of its own a request would run to the end of the context: the plan's
            # cap is its limit, within the model's context.
            body[kind.output_param] = min(cap, pool.max_model_len or cap)
        return Admissible(endpoint, kind, body, parsed, terms, pool, turn)
