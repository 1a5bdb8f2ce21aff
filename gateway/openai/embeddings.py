"""What bounds one embeddings request, checked before anything is counted or queued.

One request is one quota unit at the plan's flat price, whatever it carries, so its work is bounded
the way a completion's prompt list is (README, "One request is bounded work"): at most the plan's
``max_embedding_inputs`` inputs; each input within the model's context (vLLM would refuse it after
the unit was counted); all of them together within the plan's ``max_prompt_tokens``. Inputs are
measured as prompts are (:mod:`flatfare.gateway.openai.prompt_length`): UTF-8 bytes first, the
model's tokenizer only for those the byte bound does not clear.
"""

from __future__ import annotations

from flatfare.billing.plans import PlanRules
from flatfare.gateway.errors import invalid
from flatfare.gateway.openai.prompt_length import (BYTES_PER_TOKEN_ESTIMATE, TOKENS_PER_PROMPT, TokenCounter,
                                                   prompt_too_long, utf8_bytes)
from flatfare.gateway.openai.protocol import EmbeddingRequest
from flatfare.gateway.jobpath.pools import Pool


def check_embedding_caps(parsed: EmbeddingRequest, plan: PlanRules) -> None:
    """The plan's cap on inputs per request (400 ``too_many_inputs``)."""
    count = len(parsed.inputs())
    if count > plan.max_embedding_inputs:
        raise invalid(f"This request carries {count} inputs to embed; the {plan.name} plan allows at most "
                      f"{plan.max_embedding_inputs} per request. Send them as several requests.", param="input",
                      code="too_many_inputs")


async def check_embedding_input(parsed: EmbeddingRequest, plan: PlanRules, pool: Pool,
                                counter: TokenCounter | None) -> None:
    """Each input within the model's context (400 ``context_length_exceeded``, naming the input), all of
    them within the plan's input tokens (400 ``prompt_too_long``)."""
    context, cap = pool.max_model_len, plan.max_prompt_tokens
    inputs = parsed.inputs()
    # At least each input's tokens: a token-id list's length, a text's bytes plus its special tokens.
    bounds = [len(item) if type(item) is list else utf8_bytes(item) + TOKENS_PER_PROMPT for item in inputs]
    if context is not None:
        for index, (item, bound) in enumerate(zip(inputs, bounds, strict=True)):
            if bound <= context:
                continue
            tokens = bound if type(item) is list else (
                await _tokens(parsed.model, [item], context, counter) + TOKENS_PER_PROMPT)
            if tokens > context:
                where = "input" if len(inputs) == 1 else f"input[{index}]"
                raise invalid(f"{where.capitalize()} is {tokens} tokens; the model '{parsed.model}' embeds at most "
                              f"{context} tokens per input. Shorten it or split it.", param=where,
                              code="context_length_exceeded")
    if parsed.dimensions is not None:
        _check_dimensions(parsed.model, parsed.dimensions, pool)
    if cap is None or sum(bounds) <= cap:
        return
    texts = [item for item in inputs if type(item) is str]
    token_ids = sum(len(item) for item in inputs if type(item) is list)
    tokens = token_ids + TOKENS_PER_PROMPT * len(texts) + (await _tokens(parsed.model, texts, cap, counter) if texts
                                                           else 0)
    if tokens > cap:
        raise prompt_too_long(tokens, plan.name, cap, "input")


async def _tokens(model: str, texts: list[str], limit: int, counter: TokenCounter | None) -> int:
    """The texts' tokens with the model's tokenizer (counting stops once past ``limit``), or, before
    any worker published one, a quarter of their bytes."""
    counted = await counter.count(model, texts, limit) if counter is not None else None
    if counted is None:
        return -(-sum(utf8_bytes(text) for text in texts) // BYTES_PER_TOKEN_ESTIMATE)
    return counted.tokens


def _check_dimensions(model: str, dimensions: int, pool: Pool) -> None:
    """``dimensions`` against what the model's live engines report (``engine_config``: its embedding size,
    and its Matryoshka dimensions, False for a model that has none). A cold pool has no report: its
    engine refuses such a request itself, and the refusal is free."""
    config = next((w.extra.get("engine_config") or {} for w in pool.workers
                   if "embedding_size" in (w.extra.get("engine_config") or {})), None)
    if config is None:
        return
    size, matryoshka = config["embedding_size"], config.get("matryoshka_dimensions")
    if not matryoshka:
        raise invalid(f"The model '{model}' does not support shortened embeddings (Matryoshka): it always returns "
                      f"{size} dimensions. Leave dimensions out.", param="dimensions")
    allowed = [matryoshka] if type(matryoshka) is int else matryoshka if type(matryoshka) is list else None
    if (allowed and dimensions not in allowed) or (size and dimensions > size):
        raise invalid(f"The model '{model}' returns embeddings of {', '.join(map(str, allowed or [size]))} dimensions"
                      f"{'' if allowed else ' or fewer'}; dimensions={dimensions} is not one of them.",
                      param="dimensions")
