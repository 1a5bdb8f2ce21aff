"""Flatfare's own spans (flatfare/tracing.py): off unless configured, sampled at the edge by the client's
flag or the ratio, exported over OTLP/HTTP to a real receiver."""

from __future__ import annotations

import threading

from flatfare import tracing
from flatfare.gateway.app import create_app
from flatfare.gateway.settings import GatewaySettings
from tests.otlp_receiver import otlp_receiver, tree

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}"


def _exporting_threads() -> int:
    return sum("OtelBatchSpanProcessor" in t.name for t in threading.enumerate())


def test_tracing_is_off_by_default_and_off_builds_nothing() -> None:
    """No endpoint, or a ratio of 0: no tracer, so no SDK provider, exporter or export thread."""
    before = _exporting_threads()
    assert tracing.tracer("flatfare-gateway", "", 1.0) is None
    assert tracing.tracer("flatfare-gateway", "http://127.0.0.1:4318", 0.0) is None
    settings = GatewaySettings(redis_url="redis://127.0.0.1:1")
    assert (settings.traces_endpoint, settings.traces_sample_ratio) == ("", 0.0)
    app = create_app(settings)
    assert app.tracer is None
    assert _exporting_threads() == before


def test_spans_go_to_an_otlp_receiver_sampled_at_the_edge() -> None:
    with otlp_receiver() as receiver:
        tracer = tracing.tracer("flatfare-gateway", receiver.url, 1.0)
        assert tracer is not None and tracing.traces_url(receiver.url + "/") == receiver.url + "/v1/traces"
        # A client's sampled trace is continued and recorded, with phases and children under the request.
        trace, spans = tracer.start("POST /v1/chat/completions", CLIENT.format(flags="01"), kind="server")
        assert spans is not None and trace.header().endswith("-01")
        assert (trace.trace_id, trace.parent_id) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
        spans.begin("admission")
        spans.child("ledger write", tracing.now_ns())
        spans.finish(429, "daily_quota_exceeded")  # a refusal ends the phase it happened in
        # The client said not sampled: followed, nothing recorded, the flag goes on in the header.
        unsampled, none = tracer.start("POST /v1/chat/completions", CLIENT.format(flags="00"))
        assert none is None and unsampled.header().endswith("-00")
        # Without a traceparent, the ratio decides (1: every request).
        fresh, recorded = tracer.start("GET /v1/models", None, kind="server")
        assert recorded is not None and fresh.parent_id == "" and fresh.header().endswith("-01")
        recorded.finish(200)
        tracer.shutdown()  # flushes
        request = receiver.trace(trace.trace_id)
        root = tree(request)
        assert (root.name, root.span_id, root.parent_id) == ("POST /v1/chat/completions", trace.span_id,
                                                             "00f067aa0ba902b7")
        assert root.attributes["http.response.status_code"] == 429
        assert root.attributes["flatfare.error_code"] == "daily_quota_exceeded"
        admission = next(s for s in request if s.name == "admission")
        assert admission.attributes["flatfare.error_code"] == "daily_quota_exceeded"
        assert {s.name for s in request} == {"POST /v1/chat/completions", "admission", "ledger write"}
        assert {s.service for s in receiver.spans} == {"flatfare-gateway"}
        assert tree(receiver.trace(fresh.trace_id)).span_id == fresh.span_id
        assert len(receiver.spans) == 4


def test_a_small_ratio_leaves_most_new_traces_unsampled() -> None:
    tracer = tracing.Tracer("flatfare-gateway", _Nowhere(), ratio=1e-9)
    try:
        decisions = [tracer.start("r", None)[1] is not None for _ in range(50)]
        assert not any(decisions)
        assert tracer.start("r", CLIENT.format(flags="01"))[1] is not None  # the client's flag still wins
    finally:
        tracer.shutdown()


class _Nowhere:
    """An exporter that drops spans (the SDK's SpanExporter interface)."""

    def export(self, spans: object) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
