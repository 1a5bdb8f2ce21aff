"""A batch's input and output lines, and a line's price: plain functions."""

from __future__ import annotations

import json

from flatfare.gateway.batches.lines import not_run_line, output_line, parse_input


def _line(custom_id: str, url: str = "/v1/chat/completions", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m", "messages": [], **body}}).encode()


def test_the_lines_of_a_valid_file_keep_their_order_and_bodies() -> None:
    lines, errors = parse_input([_line("a"), b"", _line("b", max_tokens=3)], "/v1/chat/completions")
    assert errors == []
    assert [(line.custom_id, line.model) for line in lines] == [("a", "m"), ("b", "m")]
    assert json.loads(lines[1].body) == {"model": "m", "messages": [], "max_tokens": 3}


def test_every_line_the_batch_cannot_run_is_named_with_its_number() -> None:
    _, errors = parse_input([_line("a", url="/v1/completions"), _line("b", stream=True),
                             _line("c", model=7)], "/v1/chat/completions")
    assert [(e.code, e.line, e.param) for e in errors] == [
        ("mismatched_url", 1, "url"), ("invalid_request", 2, "body.stream"),
        ("missing_required_parameter", 3, "body.model")]


def test_a_malformed_file_fails_at_its_first_bad_line() -> None:
    _, errors = parse_input([_line("a"), _line("a")], "/v1/chat/completions")
    assert [(e.code, e.line) for e in errors] == [("invalid_request", 2)]
    assert "custom_id" in errors[0].message


def test_output_and_error_lines_are_openai_s_shape() -> None:
    done = json.loads(output_line("batch_x-0", "a", 200, '{"object": "chat.completion"}'))
    assert done == {"id": "batch_req_batch_x-0", "custom_id": "a", "error": None,
                    "response": {"status_code": 200, "request_id": "batch_x-0", "body": {"object": "chat.completion"}}}
    skipped = json.loads(not_run_line("batch_x-1", "b", "batch_cancelled", "not run"))
    assert skipped["response"] is None and skipped["error"] == {"code": "batch_cancelled", "message": "not run"}
