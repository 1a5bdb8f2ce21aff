"""The queue contract round-trips through Redis field maps exactly."""

from __future__ import annotations

from flatfare import contract
from flatfare.contract import Endpoint, Job, Lane, Reply, ReplyKind, Usage, WorkerInfo, WorkerState


def _as_redis(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_job_round_trip() -> None:
    job = Job(request_id="abc", endpoint=Endpoint.CHAT, body='{"model": "m"}', enqueued_ms=123, lane=Lane.PREMIUM,
              deadline_ms=456, prefix="ab12")
    assert Job.from_fields(_as_redis(job.to_fields())) == job
    assert job.priority < Job("x", Endpoint.CHAT, "{}", 0).priority  # premium runs first in the engine


def test_a_job_carries_its_requests_trace_context_and_one_from_an_older_gateway_has_none() -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    job = Job("abc", Endpoint.CHAT, "{}", 123, traceparent=traceparent)
    assert job.to_fields()["tp"] == traceparent and Job.from_fields(_as_redis(job.to_fields())) == job
    older = Job("abc", Endpoint.CHAT, "{}", 123).to_fields()
    assert "tp" not in older and Job.from_fields(_as_redis(older)).traceparent == ""


def test_reply_round_trip_keeps_usage_and_timings() -> None:
    reply = Reply(ReplyKind.END, usage=Usage(3, 4), started_ms=10, first_token_ms=20)
    assert Reply.from_fields(_as_redis(reply.to_fields())) == reply
    chunk = Reply(ReplyKind.CHUNK, '{"x": 1}')
    assert set(chunk.to_fields()) == {"k", "d"}  # chunks stay small
    assert Reply.from_fields(_as_redis(chunk.to_fields())) == chunk


def test_only_chunks_and_held_are_not_terminal() -> None:
    assert [k for k in ReplyKind if not k.terminal] == [ReplyKind.CHUNK, ReplyKind.HELD]


def test_worker_info_round_trip() -> None:
    info = WorkerInfo("w1", "m", 2048, 64, inflight=3, pool="m@acme", started_ms=5, state=WorkerState.DRAINING,
                      extra={"engine_unfinished": 2})
    assert WorkerInfo.from_fields(_as_redis(info.to_fields())) == info


def test_key_names_are_namespaced_and_distinct() -> None:
    keys = {contract.job_stream("m", Lane.PREMIUM), contract.job_stream("m", Lane.STANDARD),
            contract.worker_stream("m", "w"), contract.reply_stream("m"), contract.cancel_key("m"),
            contract.pool_key("m"), contract.worker_key("m"), contract.drained_key("m", Lane.PREMIUM),
            contract.prefix_key("m", "h"), contract.POOLS_KEY, contract.CANCEL_CHANNEL}
    assert len(keys) == 11 and all(k.startswith("ff:") for k in keys)


def test_dedicated_pools_name_their_model() -> None:
    assert contract.pool_name("m") == "m" and contract.pool_name("m", "acme") == "m@acme"
