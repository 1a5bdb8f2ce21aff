"""W3C traceparent at the gateway's edge: what is accepted, what starts a new trace."""

from __future__ import annotations

import pytest

from flatfare.tracecontext import continue_or_start, parse

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_continued_under_a_span_of_the_gateways() -> None:
    trace = continue_or_start(CLIENT)
    assert (trace.trace_id, trace.parent_id, trace.flags) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7",
                                                              "01")
    assert len(trace.span_id) == 16 and trace.span_id != trace.parent_id
    assert trace.header() == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{trace.span_id}-01"
    assert parse(trace.header()) == (trace.trace_id, trace.span_id, "01")
    assert trace.log_fields() == {"trace_id": trace.trace_id, "span_id": trace.span_id}
    # A later version may carry more fields; the four known ones are read.
    assert parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more")[0] == trace.trace_id


@pytest.mark.parametrize("value", [
    None, "", "garbage", CLIENT.upper(), CLIENT + "-extra",  # version 00 has exactly four fields
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # a short trace id
    "00-" + "a" * 600,
])
def test_anything_else_starts_a_new_unsampled_trace(value: str | None) -> None:
    assert parse(value) is None
    trace = continue_or_start(value)
    assert len(trace.trace_id) == 32 and trace.trace_id != "0" * 32 and trace.parent_id == ""
    assert trace.flags == "00" and parse(trace.header()) == (trace.trace_id, trace.span_id, "00")
    assert continue_or_start(value).trace_id != trace.trace_id
