"""Flatfare's own spans, exported over OTLP/HTTP to any collector (OpenTelemetry's SDK).

Off unless a process has both ``FLATFARE_TRACES_ENDPOINT`` and a ``FLATFARE_TRACES_SAMPLE_RATIO``
above 0: then :func:`tracer` builds nothing, no SDK object exists and the request path pays one
``is None`` test (the ids of :mod:`flatfare.tracecontext` still go into the answer and the logs).

On, each process has one :class:`Tracer` (its own ``service.name``) with a batch processor whose
thread exports finished spans in the background, flushed at shutdown. Sampling is decided once, at
the gateway's edge: a client's ``traceparent`` decides for its request (its sampled flag is
followed), a request without one is sampled with the configured probability; the decision
travels in the flags of the traceparent the job carries, so the worker, and vLLM's own OTLP export
under the worker's span, follow it. An unsampled request gets a :class:`Spans` of ``None`` and never
reaches the SDK: its ids are :func:`flatfare.tracecontext.continue_or_start`'s, as with tracing off.

The SDK's imports live here only, and only run once tracing is on.
"""

from __future__ import annotations

import random
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from flatfare import tracecontext
from flatfare.tracecontext import TraceContext

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanKind

# The OTLP/HTTP traces path a collector serves (an endpoint given without one gets it).
TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the exporter posts to it: a bare ``http://host:4318`` gets ``/v1/traces``."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def tracer(service: str, endpoint: str, ratio: float) -> Tracer | None:
    """The process's tracer, or None (tracing off: no endpoint, or a ratio of 0)."""
    if not endpoint or ratio <= 0:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return Tracer(service, OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5), ratio)


class Tracer:
    """One process's spans, exported by ``exporter`` in the background."""

    def __init__(self, service: str, exporter: SpanExporter, ratio: float = 1.0) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        from opentelemetry.trace import SpanKind

        self._kinds = SpanKind
        self.ratio = ratio
        # Not the global provider: each gateway app (and each test's) has its own, shut down with it. Its
        # sampler records all it is given: start() asks it only for sampled spans.
        self.provider: TracerProvider = TracerProvider(resource=Resource.create({"service.name": service}),
                                                       sampler=ALWAYS_ON)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.sdk = self.provider.get_tracer("flatfare")

    def start(self, name: str, traceparent: str | None, *, kind: str = "internal", start_ns: int | None = None,
              **attributes: Any) -> tuple[TraceContext, Spans | None]:
        """This process's span for a request under ``traceparent`` (a new trace when it is none or not
        valid): its trace context (for the answer, the job, the logs) and its :class:`Spans`, None
        when the trace is not sampled.

        The decision is the parent's when there is one (its sampled flag), else this ratio's (OpenTelemetry's
        ``ParentBased`` sampling, the ratio drawn per request); an unsampled request never reaches the SDK."""
        parsed = tracecontext.parse(traceparent)
        if parsed is None:
            if random.random() >= self.ratio:  # noqa: S311 - a sampling draw, not a secret
                return tracecontext.continue_or_start(None), None
            context = None
        else:
            trace_id, parent_id, flags = parsed
            if not int(flags, 16) & 1:
                return tracecontext.continue_or_start(traceparent), None
            from opentelemetry import trace
            from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

            context = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                int(trace_id, 16), int(parent_id, 16), is_remote=True, trace_flags=TraceFlags(1))))
        span = self.sdk.start_span(name, context, kind=self.kind(kind), attributes=attributes or None,
                                   start_time=start_ns)
        ids = span.get_span_context()
        return TraceContext(f"{ids.trace_id:032x}", f"{ids.span_id:016x}", parsed[1] if parsed else "", "01"), \
            Spans(self, span)

    def kind(self, kind: str) -> SpanKind:
        return getattr(self._kinds, kind.upper())

    def shutdown(self) -> None:
        """Export what is still waiting, then stop the export thread."""
        with suppress(Exception):  # a collector that is away must not hold up a shutdown
            self.provider.shutdown()


class Spans:
    """One sampled request's span in this process, and its children: phases begun and ended by name
    (:meth:`begin`, :meth:`end`), and spans timed elsewhere (:meth:`child`)."""

    __slots__ = ("_tracer", "span", "_context", "_open")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        from opentelemetry import trace

        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)
        self._open: dict[str, Span] = {}

    def begin(self, name: str, start_ns: int | None = None, **attributes: Any) -> None:
        self._open[name] = self._tracer.sdk.start_span(name, self._context, attributes=attributes or None,
                                                           start_time=start_ns)

    def end(self, name: str, end_ns: int | None = None, **attributes: Any) -> None:
        span = self._open.pop(name, None)
        if span is not None:
            _set(span, attributes)
            span.end(end_ns)

    def note(self, **attributes: Any) -> None:
        """Attributes of the request's span, known before it ends."""
        _set(self.span, attributes)

    def child(self, name: str, start_ns: int, end_ns: int | None = None, *, kind: str = "internal",
              **attributes: Any) -> None:
        """A finished child span, from ``start_ns`` to ``end_ns`` (now when None)."""
        span = self._tracer.sdk.start_span(name, self._context, kind=self._tracer.kind(kind),
                                               attributes=attributes or None, start_time=start_ns)
        span.end(end_ns)

    def finish(self, status: int | None = None, code: str | None = None, *, name: str = "",
               **attributes: Any) -> None:
        """End the request's span, and any phase still open (a refusal ends the phase it happened in):
        ``status`` is the HTTP status (a 5xx marks the span an error), ``code`` an OpenAI error code."""
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            attributes["http.response.status_code"] = status
        if code:
            attributes["flatfare.error_code"] = code
        for phase in list(self._open):
            self.end(phase, **({"flatfare.error_code": code} if code else {}))
        if name:
            self.span.update_name(name)
        _set(self.span, attributes)
        if status is not None and status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, code or f"http_{status}"))
        self.span.end()


def _set(span: Span, attributes: dict[str, Any]) -> None:
    for key, value in attributes.items():
        if value is not None and value != "":
            span.set_attribute(key, value)


def ms_to_ns(ms: int) -> int:
    return ms * 1_000_000


def now_ns() -> int:
    return time.time_ns()
