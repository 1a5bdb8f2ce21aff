"""How a request ends (flatfare.gateway.openai.settlement): charged once the engine produced output, free
when it failed before its first token; what its ledger close says."""

from __future__ import annotations

import orjson

from flatfare.contract import Reply, ReplyKind, Usage
from flatfare.gateway.errors import error_body
from flatfare.gateway.openai.settlement import billable, outcome
from flatfare.storage.models import RequestStatus


def _error(status: int, code: str, first_token_ms: int = 0) -> Reply:
    return Reply(ReplyKind.ERROR, orjson.dumps(error_body(status, "boom", code=code)).decode(), status=status,
                 started_ms=1_000, first_token_ms=first_token_ms)


def test_a_request_that_fails_before_its_first_token_is_free() -> None:
    for reply in (_error(400, "context_length_exceeded"), _error(500, "worker_error"), _error(502, "worker_lost")):
        assert not billable(reply)
        closed = outcome(reply, created_ms=900, finished_ms=1_200)
        code = orjson.loads(reply.data)["error"]["code"]
        assert (closed.status, closed.billable, closed.error_code) == (RequestStatus.FAILED, False, code)


def test_a_request_whose_engine_produced_output_is_charged_even_if_it_then_failed() -> None:
    assert billable(_error(500, "worker_error", first_token_ms=1_100))
    answered = Reply(ReplyKind.RESPONSE, "{}", usage=Usage(5, 3), started_ms=1_000, first_token_ms=1_050)
    assert billable(answered)
    closed = outcome(answered, created_ms=900, finished_ms=1_200)
    assert (closed.status, closed.billable, closed.queue_ms, closed.ttft_ms, closed.duration_ms) == (
        RequestStatus.SUCCEEDED, True, 100, 150, 300)
    assert (closed.prompt_tokens, closed.completion_tokens) == (5, 3)


def test_a_stream_that_sent_chunks_is_charged_whatever_its_last_reply_says() -> None:
    assert outcome(_error(500, "worker_error"), created_ms=900, finished_ms=1_200, produced=True).billable
