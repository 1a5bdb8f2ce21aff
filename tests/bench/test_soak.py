"""``python -m bench soak``: the verdicts can fail (a planted leak is caught), and a 30-second soak with its
restarts, batches, rotations, hang-ups and retries loses nothing and keeps the money exact.

A minute is too short to judge memory or pools that fill lazily (the hour's run, bench/results/soak.md,
judges those); what a short run can judge is checked here: every request answered or refused cleanly, the
audit exact, each retry a replay, every batch ended, no kind of Redis key without an expiry growing, and
the event-loop task counts read from both surviving processes' /metrics. The soak's clients (aiohttp) are
also run against a local server that answers like a gateway, so that each classification the money audit
and the "lost" count rely on is checked one by one.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from bench.soak import unexpiring_growth
from bench.soak.load import Done, Mix, SoakClients
from bench.soak.windows import verdicts, windows

ROOT = Path(__file__).resolve().parents[2]


def _samples(rss: list[float], tasks: list[int]) -> list[dict]:
    return [{"at_s": 10.0 * i + 1, "gateway1": {"rss_mib": r, "fds": 40, "threads": 8, "tasks": t},
             "worker1": {"rss_mib": 80.0, "fds": 20, "threads": 2, "tasks": 9}, "redis_mib": 2.0, "redis_keys": 50,
             "db_connections": 4, "outbox_pending": 120} for i, (r, t) in enumerate(zip(rss, tasks, strict=True))]


def test_a_planted_leak_is_caught_and_a_flat_run_is_not() -> None:
    done = [Done(at_s=i / 10, seconds=0.1, answered=True) for i in range(400)]
    flat = verdicts(windows(done, _samples([100, 101, 100, 101], [16, 16, 17, 16]), 10, 40), 1)
    assert all(v.ok for v in flat), flat
    grown = _samples([100, 104, 110, 118], [16, 30, 45, 60])
    for i, sample in enumerate(grown):  # a load past the outbox's rate: its backlog grows ~100 rows a second
        sample["outbox_pending"] = 1000 * i
    leaking = {v.what: v.ok for v in verdicts(windows(done, grown, 10, 40), 1)}
    assert leaking["gateway1 RSS MiB"] is False and leaking["gateway1 asyncio tasks"] is False
    assert leaking["billing outbox backlog"] is False
    assert leaking["worker1 RSS MiB"] is True
    slower = [Done(at_s=i / 10, seconds=0.1 if i < 200 else 0.2, answered=True) for i in range(400)]
    assert {v.what: v.ok for v in verdicts(windows(slower, _samples([100] * 4, [16] * 4), 10, 40), 1)}[
        "latency p99 ms"] is False


def test_each_window_shows_the_load_generators_cpu_beside_the_survivors() -> None:
    samples = _samples([100] * 4, [16] * 4)
    for i, sample in enumerate(samples):  # 0.4 s a second for the load generator, then 0.8 s
        sample["loadgen_cpu_s"] = 4.0 * i if i < 2 else 4.0 + 8.0 * (i - 1)
        sample["gateway1"]["cpu_s"] = 6.0 * i
    sample["worker1"]["cpu_s"] = 1.0  # one reading in its window: not measured
    rows = windows([Done(at_s=1.0, seconds=0.1, answered=True)], samples, 20, 40)
    assert [w.cpu_pct["load generator"] for w in rows] == [40.0, 80.0]
    assert [w.cpu_pct["gateway1"] for w in rows] == [60.0, 60.0] and rows[1].cpu_pct["worker1"] is None


def test_an_unexpiring_kind_of_redis_key_that_grows_is_a_leak() -> None:
    samples = [{"at_s": 0.0, "redis_kinds": {"ff:reply:*": [10, 0], "ff:pool:{m}": [1, 1]}},
               {"at_s": 30.0, "redis_kinds": {"ff:reply:*": [80, 0], "ff:pool:{m}": [1, 1], "ff:held:*": [9, 9]}}]
    assert unexpiring_growth(samples, 0.0) == {"ff:held:*": 9}  # the replies expire: bounded, not a leak


def test_a_short_soak_loses_nothing_and_keeps_the_money_exact(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "0.5", "--window-s", "10", "--warmup-windows", "1",
         "--capacity-s", "6", "--load", "0.5", "--chaos-every-s", "12", "--batch-every-s", "10", "--batch-lines", "5",
         "--rotate-every-s", "12", "--sample-s", "2", "--workdir", str(workdir), "--out", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    result_file = workdir / "soak.json"
    assert result_file.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    tally, events, audit = result["tally"], result["events"], result["audit"]
    assert tally["answered"] > 100 and tally["lost"] == 0, tally
    capacity = result["capacity"]  # measured through a restart, answering and billing
    assert capacity["restarts"] and capacity["lost"] == 0 and capacity["quiet_rps"] > 0, capacity
    assert 0 < capacity["rps"] < min(capacity["answers_rps"], capacity["outbox_rps"]), capacity
    assert audit["clean"] and audit["charged_twice"] == 0, audit
    assert events["retried"] > 0 and events["replay_mismatch"] == 0 and events["disconnected"] > 0, events
    assert {name for _at, name in events["restarts"]} == {"gateway0", "worker0"} and events["rotations"] >= 1, events
    assert result["batches"]["submitted"] >= 1 and len(result["batches"]["ended"]) == result["batches"]["submitted"]
    assert unexpiring_growth(result["samples"], 10.0) == {}
    late = result["samples"][-1]
    assert late["gateway1"]["tasks"] and late["worker1"]["tasks"], late  # read from both processes' /metrics
    report = (tmp_path / "results" / "soak.md").read_text()
    assert "## Verdicts" in report and "Redis keys by kind" in report
    assert (tmp_path / "results" / "soak.png").stat().st_size > 10_000


@dataclass
class FakeRig:
    """What the soak's clients read of a rig: the gateways' ports, which are being restarted, model and key."""

    ports: list[int]
    key: str = "ok"
    model: str = "m"
    dead_ports: set[int] = field(default_factory=set)
    gateway_procs: list[None] = field(default_factory=lambda: [None])
    gone: int = 0  # streams whose client went away


RIG = web.AppKey("rig", FakeRig)


async def _gateway(request: web.Request) -> web.StreamResponse:
    """Answers by the key: ok, busy (429 with the error envelope), bare (502 without one), broken (a stream's
    error event, then [DONE]), cut (a stream that stops without [DONE] and drops the connection), and
    restarted (cut, its gateway taken out of rotation first, as chaos does before a restart)."""
    rig, key = request.app[RIG], request.headers["Authorization"].removeprefix("Bearer ")
    body = await request.json()
    request_id = request.headers.get("Idempotency-Key") or f"req-{time.monotonic_ns()}"
    if key == "busy":
        return web.json_response({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                            "code": "too_many_inflight"}}, status=429)
    if key == "bare":
        return web.Response(status=502, text="Bad Gateway")
    if not body.get("stream"):
        return web.json_response({"choices": [{"message": {"content": "hi"}}]}, headers={"x-request-id": request_id})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-request-id": request_id})
    await response.prepare(request)
    try:
        await response.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
        if key in ("cut", "restarted"):
            if key == "restarted":
                rig.dead_ports.add(rig.ports[0])
            assert request.transport is not None
            request.transport.close()
            return response
        await asyncio.sleep(0.05)
        if key == "broken":
            await response.write(b'data: {"error":{"message":"lost","type":"server_error","code":"worker_lost"}}\n\n')
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        rig.gone += 1
        raise
    return response


@pytest.fixture
async def rig() -> AsyncIterator[FakeRig]:
    app = web.Application()
    found = app[RIG] = FakeRig([])
    app.router.add_post("/v1/chat/completions", _gateway)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client gone cancels its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    found.ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    yield found
    await runner.cleanup()


async def test_the_soak_clients_classify_each_answer_as_what_it_was(rig: FakeRig) -> None:
    streams = SoakClients(rig, Mix(stream=1.0), time.monotonic())  # type: ignore[arg-type]
    plain = SoakClients(rig, Mix(stream=0.0), time.monotonic())  # type: ignore[arg-type]
    try:
        assert await streams.one() and await plain.one()
        for key in ("busy", "bare", "broken", "cut", "restarted"):  # restarted: cut, not lost
            rig.key = key
            assert await streams.one() is None
        rig.dead_ports.clear()
        rig.key = "ok"
        assert await streams._retried()
        await streams._hang_up()
        rig.key = "busy"
        assert not await streams._retried()  # refused: a clean failure, not a retry
        await asyncio.sleep(0.2)
    finally:
        await streams.close()
        await plain.close()
    tally, events = streams.tally, streams.events
    assert (tally.answered, plain.tally.answered) == (2, 1), tally
    assert tally.failed == {"429 too_many_inflight": 2, "worker_lost": 1}, tally
    assert (tally.lost, tally.cut) == (2, 1), tally
    assert tally.lost_examples[0].startswith("502 without an error body"), tally.lost_examples
    assert [e["why"].split(":")[0] for e in events.lost] == ["ClientPayloadError"], events.lost
    assert (events.retried, events.replay_mismatch, events.disconnected, rig.gone) == (1, 0, 1, 1), (events, rig)
