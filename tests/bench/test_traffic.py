"""bench/traffic.py against a local HTTP server that answers like the gateway (the transport edge is
all that is faked): what each answer is recorded as, the same clients sending the same requests,
Retry-After honoured, a background load cut off once the measured group is answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from bench.traffic import CUT_OFF, NO_CONNECTION, Group, GroupSummary, Request, percentile, run_groups, send


@dataclass
class Edge:
    """What the fake gateway was sent: (key, prompt) per request, and requests whose client went away."""

    url: str
    seen: list[tuple[str, str]] = field(default_factory=list)
    gone: int = 0


EDGE = web.AppKey("edge", Edge)


async def _chat(request: web.Request) -> web.StreamResponse:
    edge = request.app[EDGE]
    key = request.headers["Authorization"].removeprefix("Bearer ")
    body = await request.json()
    edge.seen.append((key, body["messages"][0]["content"]))
    if key.startswith("busy"):
        error = {"error": {"message": "too many", "type": "rate_limit_error", "param": None,
                           "code": "too_many_inflight"}}
        return web.json_response(error, status=429, headers={"Retry-After": "1"})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-flatfare-queue-ms": "12"})
    await response.prepare(request)
    try:
        if key.startswith("hang"):
            await asyncio.sleep(60)
        await response.write(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
        if key.startswith("broken"):
            await response.write(b'data: {"error":{"message":"lost","code":"worker_lost"}}\n\n')
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        edge.gone += 1
        raise
    return response


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    app = web.Application()
    found = app[EDGE] = Edge("")
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client gone cancels its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    found.url = f"http://127.0.0.1:{port}/v1/chat/completions"
    yield found
    await runner.cleanup()


async def test_each_answer_is_recorded_as_what_it_was(edge: Edge) -> None:
    request = Request(edge.url, "m", 4)
    async with aiohttp.ClientSession() as session:
        ok = await send(session, request, "ok", "p", "g", 0, 0.0)
        refused = await send(session, request, "busy", "p", "g", 0, 0.0)
        broken = await send(session, request, "broken", "p", "g", 0, 0.0)
        nowhere = await send(session, Request("http://127.0.0.1:9/v1/chat/completions", "m", 4), "ok", "p", "g", 0,
                             0.0)
    assert (ok.status, ok.code, ok.ttft_s is not None, ok.queue_ms) == (200, "", True, 12.0)
    assert (refused.status, refused.code, refused.retry_after, refused.refused) == (429, "too_many_inflight", "1",
                                                                                   True)
    assert (broken.status, broken.code) == (200, "worker_lost")
    assert nowhere.status == NO_CONNECTION
    summary = GroupSummary.of([ok, refused, broken, nowhere])
    assert (summary.sent, summary.answered, summary.refused, summary.other_errors) == (4, 1, 1, 2)
    assert summary.refusals_with_retry_after == 1
    assert summary.queue_p50_ms == 12.0
    assert summary.codes == {"too_many_inflight": 1, "worker_lost": 1, nowhere.code: 1}
    body = json.loads(request.body("hello"))
    assert body["stream"] is True and body["ignore_eos"] is True and body["messages"][0]["content"] == "hello"


async def test_the_same_open_loop_group_sends_the_same_requests(edge: Edge) -> None:
    group = Group("premium", ("ok-a", "ok-b"), rate=40.0)
    first = await run_groups(Request(edge.url, "m", 4), [group], 0.5, 0.0, seed=7)
    sent_first = sorted(edge.seen)
    edge.seen.clear()
    second = await run_groups(Request(edge.url, "m", 4), [group], 0.5, 0.0, seed=7)
    assert sent_first and sorted(edge.seen) == sent_first
    assert {key for key, _ in sent_first} == {"ok-a", "ok-b"}  # every account sends
    assert len(first.of("premium")) == len(second.of("premium")) == len(sent_first)
    edge.seen.clear()
    await run_groups(Request(edge.url, "m", 4), [group], 0.5, 0.0, seed=8)
    assert sorted(edge.seen) != sent_first  # another seed: other requests


async def test_closed_loop_clients_wait_the_refusals_retry_after(edge: Edge) -> None:
    # Refused at once with Retry-After: 1 inside a window of 0.2 s: each client sends once.
    result = await run_groups(Request(edge.url, "m", 4), [Group("flood", ("busy",), clients=5)], 0.2, 0.0, seed=1)
    assert len(edge.seen) == 5
    assert GroupSummary.of(result.of("flood")).refused == 5


async def test_the_background_is_cut_off_once_the_measured_group_is_answered(edge: Edge) -> None:
    background = Group("standard", ("hang",), clients=3, measured=False)
    measured = Group("premium", ("ok",), rate=20.0)
    result = await run_groups(Request(edge.url, "m", 4), [background, measured], 0.3, 0.1, seed=3)
    cut = [o for o in result.outcomes if o.group == "standard"]
    assert len(cut) == 3 and all(o.status == CUT_OFF for o in cut)
    assert all(o.sent_s < 0 for o in cut)  # sent while the background settled, before the window
    assert result.of("standard") == []
    for _ in range(100):  # the server sees the three clients go (their jobs would be cancelled)
        if edge.gone == 3:
            break
        await asyncio.sleep(0.05)
    assert edge.gone == 3
    assert all(o.status == 200 for o in result.of("premium"))


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([2.0, 1.0], 50) == 1.0
    assert percentile([], 99) is None
