"""What a request must satisfy before anything is counted, queued or written: the plan's caps, the
model's context, and the two headers the platform reads (its body is parsed by its kind's wire model,
:mod:`flatfare.gateway.openai.kinds`). Plain functions, testable without HTTP, Redis or a database; each
raises the client's :class:`~flatfare.gateway.errors.APIError`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from flatfare.billing.plans import AccountTerms, PlanRules
from flatfare.storage.models import RequestRecord
from flatfare.gateway.auth import KeyLimits
from flatfare.gateway.errors import APIError, invalid
from flatfare.gateway.jobpath.pools import Pool
from flatfare.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

MAX_IDEMPOTENCY_KEY = 255


def check_fits(parsed: ChatCompletionRequest | CompletionRequest, pool: Pool) -> None:
    wanted = parsed.output_tokens()
    if wanted is not None and pool.max_model_len is not None and wanted > pool.max_model_len:
        param = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise invalid(f"{param} is too large: {wanted}. The model '{pool.model}' supports at most "
                      f"{pool.max_model_len} tokens of context.", param=param)


def check_caps(parsed: Any, terms: AccountTerms, body_bytes: int,
               work: Callable[[Any, PlanRules], None] | None = None) -> None:
    """The plan's per-request caps, checked before any quota unit is counted: body size, model, and the
    request's work as its kind bounds it (``work``, by default a generation's)."""
    plan = terms.plan
    if body_bytes > plan.max_body_bytes:
        raise APIError(413, f"The request body is larger than the {plan.name} plan's limit of "
                       f"{plan.max_body_bytes} bytes.", code="request_too_large")
    if not plan.allows_model(parsed.model):
        raise APIError(403, f"The {plan.name} plan does not include the model '{parsed.model}'.",
                       param="model", code="model_not_allowed")
    (work or check_generation_caps)(parsed, plan)


def check_generation_caps(parsed: ChatCompletionRequest | CompletionRequest, plan: PlanRules) -> None:
    """A generation's work: sequences (prompts x n, x best_of when larger) and output tokens."""
    if (sequences := parsed.sequences()) > plan.max_n:
        raise invalid(_too_many_sequences(parsed, sequences, plan.name, plan.max_n),
                      param="prompt" if parsed.prompts() > 1 else ("best_of" if (parsed.best_of or 1) > (parsed.n or 1)
                                                                   else "n"),
                      code="too_many_sequences")
    wanted = parsed.output_tokens()
    if plan.max_output_tokens is not None and wanted is not None and wanted > plan.max_output_tokens:
        param = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise invalid(f"{param} is {wanted}; the {plan.name} plan allows at most {plan.max_output_tokens} "
                      "output tokens per request.", param=param)


def check_key_allows(parsed: ChatCompletionRequest | CompletionRequest | EmbeddingRequest, key: KeyLimits) -> None:
    """The API key's own model list (within the plan's), checked before any quota unit is counted."""
    if not key.allows_model(parsed.model):
        raise APIError(403, f"The API key {key.label} may not use the model '{parsed.model}'; it may use: "
                       f"{', '.join(key.allowed_models or ())}. Use another key, or ask an administrator to "
                       "add the model to this key.", param="model", code="model_not_allowed_for_key")


def _too_many_sequences(parsed: ChatCompletionRequest | CompletionRequest, sequences: int, plan: str,
                        allowed: int) -> str:
    """Say what the request's work is made of: one request is one price, so it is bounded."""
    parts = []
    if (prompts := parsed.prompts()) > 1:
        parts.append(f"{prompts} prompts")
    width = max(parsed.n or 1, parsed.best_of or 1)
    parts.append(f"best_of={parsed.best_of}" if (parsed.best_of or 1) > (parsed.n or 1) else f"n={width}")
    return (f"This request asks for {sequences} generated sequences ({' x '.join(parts)}); the {plan} plan "
            f"allows at most {allowed} per request. Send the prompts as separate requests, or lower n.")


MAX_QUEUE_DEADLINE_MS = 86_400_000


def deadline_ms_of(headers: dict[str, str], now: datetime) -> int:
    """The wall-clock ms past which a still-queued job is dropped (x-flatfare-max-queue-ms); 0: none."""
    raw = headers.get("x-flatfare-max-queue-ms")
    if raw is None:
        return 0
    if not raw.strip().isdigit() or not 0 < int(raw) <= MAX_QUEUE_DEADLINE_MS:
        raise invalid(f"x-flatfare-max-queue-ms must be a whole number of milliseconds from 1 to "
                      f"{MAX_QUEUE_DEADLINE_MS}.", param="x-flatfare-max-queue-ms")
    return int(now.timestamp() * 1000) + int(raw)


def idempotency_key_of(headers: dict[str, str]) -> str | None:
    key = headers.get("idempotency-key")
    if key is None:
        return None
    key = key.strip()
    if not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise invalid(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters.", param="Idempotency-Key")
    return key


def expired(record: RequestRecord, now: datetime, window_s: int) -> bool:
    """Whether an idempotent request's row is past the window in which a retry replays it."""
    return (now - record.created_at).total_seconds() > window_s
