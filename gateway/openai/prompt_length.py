"""A request's prompt length in tokens against its plan's ``max_prompt_tokens``, checked before anything
is counted or queued, and cheaply: nearly every request passes on its byte count alone.

The byte bound: a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) gives every token at least
one byte of the text, and a SentencePiece one (Llama 2, Mistral) at least one character, so a text
has at most as many tokens as UTF-8 bytes. What the text does not hold is added on top: special
tokens and the prefix space per prompt (:data:`TOKENS_PER_PROMPT`), the chat template's role markers
per message (:data:`TOKENS_PER_MESSAGE`). A tokenizer whose normalizer lengthens text (NFKC turns
some characters into many, even NFC splits a few) can exceed the bound on text made of such
characters; the default model's (SmolLM2) has no normalizer.

Only a prompt whose bound passes the cap is tokenized, with the model's own tokenizer (its worker
publishes it, see :mod:`flatfare.gateway.jobpath.tokenizer_cache`), in a thread. Before any worker of the
model has published one, the count is :func:`PromptParts.estimate`: a quarter of the bytes (English
text averages about four bytes a token), which lets a long prompt through rather than refuse it on a
count known to be too high.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import orjson

from flatfare.billing.plans import PlanRules
from flatfare.gateway.errors import APIError, invalid
from flatfare.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from flatfare.gateway.jobpath.tokenizer_cache import Counted

# Tokens a chat template wraps each message in (role markers, separators): SmolLM2's and Llama 3's
# take 4 to 5.
TOKENS_PER_MESSAGE = 8
# Tokens outside a prompt's text: a BOS token, SentencePiece's prefix space.
TOKENS_PER_PROMPT = 2
# The estimate without a tokenizer: bytes per token (English text averages about 4).
BYTES_PER_TOKEN_ESTIMATE = 4


class TokenCounter(Protocol):
    async def count(self, model: str, texts: Sequence[str], limit: int) -> Counted | None:
        """The tokens of ``texts`` with ``model``'s tokenizer, counted at least until they pass ``limit``;
        None when none is published."""


@dataclass(frozen=True, slots=True)
class PromptParts:
    """What a request sends the model as input: texts to tokenize, token ids, tokens around them."""

    texts: tuple[str, ...]
    token_ids: int = 0
    overhead: int = 0

    def text_bytes(self) -> int:
        return sum(utf8_bytes(text) for text in self.texts)

    def byte_bound(self) -> int:
        """At least the prompt's tokens (see the module's docstring)."""
        return self.text_bytes() + self.token_ids + self.overhead

    def estimate(self) -> int:
        """The count without a tokenizer: a quarter of the bytes, rounded up."""
        return -(-self.text_bytes() // BYTES_PER_TOKEN_ESTIMATE) + self.token_ids + self.overhead

    def with_text_tokens(self, text_tokens: int) -> int:
        return text_tokens + self.token_ids + self.overhead


def utf8_bytes(text: str) -> int:
    # An ASCII string's length is its byte count (str.isascii reads a flag): no copy for most prompts.
    return len(text) if text.isascii() else len(text.encode())


def prompt_parts(parsed: ChatCompletionRequest | CompletionRequest) -> PromptParts:
    """The request's input: every message's text parts (and tool calls, tool definitions, as the JSON
    a template renders), or every prompt of a completion; token-id prompts by their length."""
    if isinstance(parsed, ChatCompletionRequest):
        texts: list[str] = []
        for message in parsed.messages:
            content = message.content
            if type(content) is str:
                texts.append(content)
            elif content:
                texts.extend(part["text"] for part in content
                             if part.get("type") == "text" and type(part.get("text")) is str)
            if message.model_extra:  # tool_calls, reasoning: text the template renders too
                texts.append(orjson.dumps(message.model_extra).decode())
        if parsed.tools:
            texts.append(orjson.dumps(parsed.tools).decode())
        return PromptParts(tuple(texts), overhead=TOKENS_PER_MESSAGE * len(parsed.messages))
    prompt = parsed.prompt
    suffix = (parsed.suffix,) if parsed.suffix else ()
    if type(prompt) is str:
        return PromptParts((prompt, *suffix), overhead=TOKENS_PER_PROMPT)
    if prompt and type(prompt[0]) is int:
        return PromptParts(suffix, token_ids=len(prompt), overhead=TOKENS_PER_PROMPT)
    if prompt and type(prompt[0]) is str:
        return PromptParts((*prompt, *suffix), overhead=TOKENS_PER_PROMPT * len(prompt))
    return PromptParts(suffix, token_ids=sum(len(ids) for ids in prompt), overhead=TOKENS_PER_PROMPT * len(prompt))


async def check_prompt_length(parsed: ChatCompletionRequest | CompletionRequest, plan: PlanRules,
                              counter: TokenCounter | None) -> None:
    """Refuse a prompt longer than the plan allows (400 prompt_too_long). All of a request's prompts
    count together: one request is one price."""
    cap = plan.max_prompt_tokens
    if cap is None:
        return
    parts = prompt_parts(parsed)
    if parts.byte_bound() <= cap:
        return
    counted: Counted | None = Counted(0)  # token ids alone are counted exactly
    if parts.texts:
        counted = await counter.count(parsed.model, parts.texts, cap) if counter is not None else None
    tokens = parts.estimate() if counted is None else parts.with_text_tokens(counted.tokens)
    if tokens > cap:
        raise prompt_too_long(tokens, plan.name, cap, "messages" if isinstance(parsed, ChatCompletionRequest)
                              else "prompt", at_least=counted is not None and not counted.complete)


def prompt_too_long(tokens: int, plan: str, cap: int, param: str, at_least: bool = False) -> APIError:
    """``at_least``: counting stopped once past the cap (see the tokenizer cache)."""
    size = f"at least {tokens}" if at_least else str(tokens)
    return invalid(f"This request's prompt is {size} tokens; the {plan} plan allows at most {cap} input tokens "
                   f"per request. Shorten the {param}, or send it as several requests.", param=param,
                   code="prompt_too_long")
