"""W3C Trace Context (https://www.w3.org/TR/trace-context/) across Flatfare's processes.

At the gateway's edge a client's ``traceparent`` is accepted, the request gets a span id of its own
under the client's trace (a fresh trace when the client sent none, or one that is not valid), and the
answer's ``traceparent`` header names the gateway's span, so a client can find the request in its own
traces and in Flatfare's logs. The job the gateway queues carries that header (``Job.traceparent``);
the worker that runs it continues it under a span of its own (:func:`continue_or_start` again) and
hands its own span's header to vLLM's engine, whose OTLP export (when the operator switches it on)
continues the same trace. Every log line written for the request, in the gateway and in the worker,
carries ``trace_id`` and ``span_id`` (:meth:`TraceContext.log_fields`, bound through
:mod:`flatfare.logs`' context).

Parsing and formatting only: no tracing SDK, nothing exported, a few microseconds a request. Spans of
Flatfare's own, when switched on, are :mod:`flatfare.tracing`'s, which takes the ids from the SDK.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str
    # This process's span for the request, and the span it continues ("" for a fresh trace): the client's
    # at the gateway, the gateway's in the worker.
    span_id: str
    parent_id: str = ""
    flags: str = "00"

    def header(self) -> str:
        """The ``traceparent`` of this process's span: for the answer, the job, the engine."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    def log_fields(self) -> dict[str, str]:
        return {"trace_id": self.trace_id, "span_id": self.span_id}


def parse(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid ``traceparent``; None otherwise. Version ``ff`` is
    invalid; version 00 must have exactly four fields, a later version may have more (the spec's rule)."""
    if not value or len(value) > 512:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id, flags


def continue_or_start(value: str | None) -> TraceContext:
    """The request's trace context in this process: a new span under ``value``'s trace when it is a valid
    ``traceparent`` (the client's, or the gateway's for a worker), else a new trace, not sampled (with
    tracing on, :meth:`flatfare.tracing.Tracer.start` takes this one's place and decides)."""
    span_id = secrets.token_hex(8)
    parsed = parse(value)
    if parsed is None:
        return TraceContext(secrets.token_hex(16), span_id)
    trace_id, parent_id, flags = parsed
    return TraceContext(trace_id, span_id, parent_id, flags)
