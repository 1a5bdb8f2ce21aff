"""What a ``batch`` file must hold (OpenAI's Batch API input): JSON Lines, each line one request object
``{"custom_id", "method": "POST", "url", "body"}`` with a unique ``custom_id``. Checked whole at upload,
so a batch never starts on a file it cannot run; the batch runner reads the same lines back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

# OpenAI's limit on a batch input file's requests.
MAX_LINES = 50_000
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class BadBatchLine(ValueError):
    """The file is no valid batch input; ``line`` is 1-based, as an editor counts (None: the whole file)."""

    def __init__(self, line: int | None, message: str) -> None:
        super().__init__(f"Line {line}: {message}" if line else message)
        self.line = line


def batch_requests(lines: Iterable[bytes]) -> Iterable[tuple[int, dict[str, Any]]]:
    """Each request of the file with its line number, checked; blank lines are skipped."""
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            raise BadBatchLine(number, f"a batch file holds at most {MAX_LINES:,} requests.")
        yield number, _request(number, raw, seen)
    if not count:
        raise BadBatchLine(None, "The batch file holds no request: one JSON object a line.")


def check_batch_file(lines: Iterable[bytes]) -> int:
    """The number of requests in a valid batch file; :class:`BadBatchLine` at its first bad line."""
    return sum(1 for _ in batch_requests(lines))


def _request(number: int, raw: bytes, seen: set[str]) -> dict[str, Any]:
    try:
        request = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadBatchLine(number, f"not valid JSON ({exc}).") from None
    if not isinstance(request, dict):
        raise BadBatchLine(number, "each line must be a JSON object with custom_id, method, url and body.")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadBatchLine(number, "'custom_id' must be a non-empty string.")
    if custom_id in seen:
        raise BadBatchLine(number, f"the custom_id '{custom_id[:64]}' is used by an earlier line; each must be "
                           "unique.")
    seen.add(custom_id)
    if request.get("method") != "POST":
        raise BadBatchLine(number, "'method' must be \"POST\".")
    if request.get("url") not in URLS:
        raise BadBatchLine(number, f"'url' must be one of {', '.join(URLS)}.")
    if not isinstance(request.get("body"), dict):
        raise BadBatchLine(number, "'body' must be a JSON object: the request's body.")
    return request
