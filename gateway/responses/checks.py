"""What a Responses request must satisfy before anything is counted, as its job kind's row
(:data:`flatfare.gateway.openai.kinds.KINDS`) runs it: the plan's output cap, the model's context, and
the plan's input tokens over the whole conversation the engine reads (earlier turns included)."""

from __future__ import annotations

import orjson

from flatfare.billing.plans import PlanRules
from flatfare.gateway.errors import invalid
from flatfare.gateway.openai.prompt_length import TOKENS_PER_MESSAGE, PromptParts, TokenCounter, prompt_too_long
from flatfare.gateway.jobpath.pools import Pool
from flatfare.gateway.responses.protocol import ResponsesRequest


def check_response_caps(parsed: ResponsesRequest, plan: PlanRules) -> None:
    """One response is one generated sequence: the plan bounds its output tokens."""
    wanted = parsed.max_output_tokens
    if plan.max_output_tokens is not None and wanted is not None and wanted > plan.max_output_tokens:
        raise invalid(f"max_output_tokens is {wanted}; the {plan.name} plan allows at most {plan.max_output_tokens} "
                      "output tokens per request.", param="max_output_tokens")


async def check_response_input(parsed: ResponsesRequest, plan: PlanRules, pool: Pool,
                               counter: TokenCounter | None) -> None:
    wanted = parsed.max_output_tokens
    if wanted is not None and pool.max_model_len is not None and wanted > pool.max_model_len:
        raise invalid(f"max_output_tokens is too large: {wanted}. The model '{pool.model}' supports at most "
                      f"{pool.max_model_len} tokens of context.", param="max_output_tokens")
    cap = plan.max_prompt_tokens
    if cap is None:
        return
    parts = input_parts(parsed)
    if parts.byte_bound() <= cap:
        return
    counted = await counter.count(parsed.model, parts.texts, cap) if counter is not None else None
    tokens = parts.estimate() if counted is None else parts.with_text_tokens(counted.tokens)
    if tokens > cap:
        raise prompt_too_long(tokens, plan.name, cap, "input", at_least=counted is not None and not counted.complete)


def input_parts(parsed: ResponsesRequest) -> PromptParts:
    """The text the template renders: instructions, every item's text (a function call's arguments, a
    tool's output, a reasoning item's text, as their JSON), and the tools' definitions."""
    texts = [parsed.instructions] if parsed.instructions else []
    items = parsed.items()
    for item in items:
        content = item.get("content")
        if type(content) is str:
            texts.append(content)
        elif type(content) is list:
            texts.extend(part["text"] for part in content if isinstance(part, dict) and type(part.get("text")) is str)
        rest = {key: value for key, value in item.items() if key not in ("content", "type", "role", "id", "status")}
        if rest:
            texts.append(orjson.dumps(rest).decode())
    if parsed.tools:
        texts.append(orjson.dumps(parsed.tools).decode())
    return PromptParts(tuple(texts), overhead=TOKENS_PER_MESSAGE * (len(items) + 1))
