"""A batch's input and output files, line by line: plain functions, no IO.

Input: JSONL, one request a line, ``{"custom_id", "method": "POST", "url", "body"}``. Output and
error files: JSONL of ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``, as OpenAI writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flatfare.gateway.files.batch_input import BadBatchLine, batch_requests


@dataclass(frozen=True, slots=True)
class InputLine:
    custom_id: str
    model: str
    # The request body as the worker gets it (JSON text, never streamed).
    body: str


@dataclass(frozen=True, slots=True)
class InputError:
    """One reason the input file was refused: the batch fails with all of them (OpenAI's ``errors``)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_input(lines: Iterable[bytes], endpoint: str) -> tuple[list[InputLine], list[InputError]]:
    """The requests of an input file for a batch calling ``endpoint``. The Files API checked each line's
    shape at upload (:mod:`flatfare.gateway.files.batch_input`, read again here); this adds what only
    the batch knows: its endpoint. A batch runs only with no error at all, as OpenAI's does."""
    parsed: list[InputLine] = []
    errors: list[InputError] = []
    try:
        for number, request in batch_requests(lines):
            body = request["body"]
            if request["url"] != endpoint:
                errors.append(InputError("mismatched_url", f"url must be the batch's endpoint, {endpoint}.",
                                         number, "url"))
            elif not isinstance(body.get("model"), str) or not body["model"]:
                errors.append(InputError("missing_required_parameter", "body.model must name a model.", number,
                                         "body.model"))
            elif body.get("stream"):
                errors.append(InputError("invalid_request", "Batch requests are not streamed: leave out stream.",
                                         number, "body.stream"))
            else:
                parsed.append(InputLine(request["custom_id"], body["model"], json.dumps(body, separators=(",", ":"))))
    except BadBatchLine as exc:
        errors.append(InputError("invalid_request", str(exc), exc.line))
    return parsed, errors


def output_line(request_id: str, custom_id: str, status_code: int, body: str) -> str:
    """A line of the output file (a 2xx answer) or of the error file (an error answer)."""
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id, "body": json.loads(body)},
                       "error": None}, separators=(",", ":"))


def not_run_line(request_id: str, custom_id: str, code: str, message: str) -> str:
    """A line of the error file for a request that never ran (its batch was cancelled or expired)."""
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, separators=(",", ":"))
