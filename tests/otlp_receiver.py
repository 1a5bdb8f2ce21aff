"""A real OTLP/HTTP traces endpoint for the tests: ``POST /v1/traces`` of protobuf
ExportTraceServiceRequests (what OpenTelemetry's OTLP/HTTP exporter sends, and a collector accepts),
decoded with opentelemetry-proto and kept in memory."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                        ExportTraceServiceResponse)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(), kind=span.kind,
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano, status_code=span.status.code,
                    attributes={a.key: _value(a.value) for a in span.attributes}))
    return spans


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or "protobuf" not in self.headers.get("content-type", ""):
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                receiver.spans.extend(decode(body))
                receiver.requests += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def wait(self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15) -> list[ReceivedSpan]:
        """The spans received, once ``ready`` says they are all there."""
        deadline = time.monotonic() + timeout_s
        while not ready(spans := list(self.spans)):
            assert time.monotonic() < deadline, f"timed out; received: {sorted((s.service, s.name) for s in spans)}"
            time.sleep(0.05)
        return spans


@contextmanager
def otlp_receiver() -> Iterator[OTLPReceiver]:
    receiver = OTLPReceiver()
    thread = threading.Thread(target=receiver._server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()


def tree(spans: list[ReceivedSpan]) -> ReceivedSpan:
    """The one root of ``spans`` (the span whose parent is not among them), asserting that every other
    span hangs under it: one connected trace."""
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans), "span ids repeat"
    roots = [s for s in spans if s.parent_id not in ids]
    assert len(roots) == 1, f"not one connected trace: roots {[(r.service, r.name, r.parent_id) for r in roots]}"
    assert len({s.trace_id for s in spans}) == 1
    return roots[0]
