"""The rehearsal's client (bench/rehearsal/client.py) against a small server that answers as platforms do:
a streamed answer with its usage, a refusal with OpenAI's error body, an error event mid-stream, and a
stream cut without [DONE]; each is recorded as what it was, and only the cut one is lost. Then prompts of a
given length in the built-in model's own tokenizer."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from bench.rehearsal.client import Record, Target, Words, body, send
from bench.rehearsal.schedule import MAIN, Send

import aiohttp


async def _stream(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    how = payload["messages"][0]["content"]
    if how == "refuse":
        return web.json_response({"error": {"message": "over quota", "type": "rate_limit_error", "param": None,
                                            "code": "quota_exceeded"}}, status=429, headers={"Retry-After": "3"})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-flatfare-queue-ms": "7"})
    await response.prepare(request)
    for i in range(3):
        await response.write(b'data: {"id":"x","choices":[{"delta":{"content":"a"}}]}\n\n')
        await asyncio.sleep(0.01)
        if how == "fail" and i == 1:
            await response.write(b'data: {"error":{"message":"lost","code":"worker_lost"}}\n\n')
            await response.write(b"data: [DONE]\n\n")
            return response
        if how == "cut" and i == 1:
            return response  # no [DONE], no error: the client cannot tell what happened
    await response.write(b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n')
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1/chat/completions"
    await runner.cleanup()


async def _one(url: str, how: str, keys: dict[int, str] | None = None) -> Record:
    target = Target(url, keys if keys is not None else {1: "ff-k"}, {MAIN: "m"})
    record = Record(0, 1, "pro", MAIN, 0.0)
    async with aiohttp.ClientSession() as session:
        await send(session, target, record, body(target, MAIN, how, 3, "standard"), 0.0)
    return record


async def test_each_answer_is_recorded_as_what_it_was(server: str) -> None:
    ok = await _one(server, "ok")
    assert ok.answered and not ok.lost and ok.chunks == 3 and ok.completion_tokens == 3 and ok.queue_ms == 7
    assert ok.ttft_s is not None and len(ok.gaps) == 2 and ok.tpot_s is not None and ok.tpot_s >= 0.005
    refused = await _one(server, "refuse")
    assert (refused.status, refused.code, refused.retry_after, refused.lost) == (429, "quota_exceeded", "3", False)
    assert not refused.answered
    failed = await _one(server, "fail")
    assert (failed.status, failed.code, failed.lost, failed.answered) == (200, "worker_lost", False, False)
    cut = await _one(server, "cut")
    assert cut.lost and not cut.answered


def test_vllm_serve_gets_the_engine_priority_and_no_key() -> None:
    plain = orjson.loads(body(Target("u", {}, {MAIN: "m"}), MAIN, "hi", 4, "premium"))
    assert plain["priority"] == 0 and plain["ignore_eos"] and plain["stream_options"] == {"include_usage": True}
    assert Target("u", {}, {}).headers(1) == {"Content-Type": "application/json"}
    ours = orjson.loads(body(Target("u", {1: "k"}, {MAIN: "m"}), MAIN, "hi", 4, "premium"))
    assert "priority" not in ours  # Flatfare's worker sets it from the lane; a client's would be refused


def test_prompts_are_as_long_as_asked_in_the_models_tokenizer(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    words = Words.from_tokenizer(tokenizer_json)
    tokenizer = Tokenizer.from_file(tokenizer_json)
    rng = random.Random(1)
    for tokens in (50, 1_000):
        prompt = words.prompt(tokens, rng)
        counted = len(tokenizer.encode(" " + prompt, add_special_tokens=False).ids)
        assert counted == tokens - Words.OVERHEAD
    assert words.prompt(1000, random.Random(2)) != words.prompt(1000, random.Random(3))


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from bench.rehearsal import _source

    return _source("builtin:smollm2-135m-instruct") + "/tokenizer.json"


def test_a_send_is_a_plain_record() -> None:
    record = Record(3, 7, "free", MAIN, 1.5)
    saved = record.saved()
    assert "gaps" not in saved and saved["itl_p99_s"] is None and saved["rank"] == 7
    assert Send(0, 0.0, 24, 1, 10, 5).batch is False
