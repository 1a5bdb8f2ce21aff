"""Batch input files checked line by line, without HTTP (the API's answers: test_files_api.py)."""

from __future__ import annotations

import json

import pytest

from flatfare.gateway.files.batch_input import MAX_LINES, BadBatchLine, batch_requests, check_batch_file


def line(custom_id: str, **changes: object) -> bytes:
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
               "body": {"model": "m", "prompt": "hi"}, **changes}
    return json.dumps(request).encode() + b"\n"


def test_a_valid_file_counts_its_requests_and_skips_blank_lines() -> None:
    assert check_batch_file([line("a"), b"\n", line("b"), b"  \n"]) == 2
    assert [number for number, _ in batch_requests([line("a"), b"\n", line("b")])] == [1, 3]


def test_the_line_cap() -> None:
    many = (line(f"r{n}") for n in range(MAX_LINES + 1))
    with pytest.raises(BadBatchLine) as caught:
        check_batch_file(many)
    assert caught.value.line == MAX_LINES + 1
    assert check_batch_file(line(f"r{n}") for n in range(MAX_LINES)) == MAX_LINES


@pytest.mark.parametrize(("lines", "bad"), [
    ([line("a"), b'{"custom_id": "b", "method": "POST"'], 2),
    ([line("a"), line("a")], 2),
    ([line("")], 1),
    ([line("a", method="post")], 1),
    ([line("a"), line("b"), line("c", url="/v1/chat/completions/")], 3),
    ([line("a", body=None)], 1),
    ([b'"just a string"\n'], 1),
    ([b"\xff\xfe\n"], 1),
])
def test_the_first_bad_line_is_named(lines: list[bytes], bad: int) -> None:
    with pytest.raises(BadBatchLine) as caught:
        check_batch_file(lines)
    assert caught.value.line == bad and str(caught.value).startswith(f"Line {bad}: ")


def test_an_empty_file_is_no_batch() -> None:
    with pytest.raises(BadBatchLine) as caught:
        check_batch_file([b"\n"])
    assert caught.value.line is None
