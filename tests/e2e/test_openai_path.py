"""The whole request path through the official ``openai`` SDK: gateway -> Redis -> vLLM worker -> answer."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.contract import WorkerInfo

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)


def _ledger_count(stack) -> int:
    return stack.sql("SELECT count(*) FROM requests")[0][0]


def _workers(stack) -> list[WorkerInfo]:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        ids = client.zrange(contract.pool_key(stack.model), 0, -1)
        return [WorkerInfo.from_fields(client.hgetall(contract.worker_key(i.decode()))) for i in ids]
    finally:
        client.close()


def _queue_is_empty(stack) -> bool:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        stream = contract.job_stream(stack.model)
        pending = client.xpending(stream, contract.POOL_GROUP)["pending"]
        waiting = int(client.get(contract.queued_key(stack.model, contract.Lane.STANDARD)) or 0)
        return client.xlen(stream) == 0 and pending == 0 and waiting == 0
    finally:
        client.close()


def _nothing_in_flight(stack) -> bool:
    """The test account has no request in flight (the set its plan's in-flight cap counts)."""
    [(account_id,)] = stack.sql("SELECT id FROM accounts WHERE name = 'e2e'")
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return client.zcard(contract.inflight_key(account_id)) == 0
    finally:
        client.close()


def _wait_queue_empty(stack, timeout_s: float = 10) -> None:
    """Until every job is acknowledged: a worker acknowledges one only after its reply went out."""
    deadline = time.monotonic() + timeout_s
    while not _queue_is_empty(stack):
        assert time.monotonic() < deadline, "jobs still queued or held"
        time.sleep(0.1)


def test_keys_create_prints_only_the_key(stack) -> None:
    out = stack.cli("keys", "create", "--account", "scripted")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"ff-[A-Za-z0-9_-]{43}\n", out.stdout)


def test_chat_answers_paris(client) -> None:
    reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.choices[0].finish_reason == "stop"


def test_stream_text_equals_non_stream_text(client) -> None:
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                           max_tokens=24)
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # Without include_usage, no chunk carries usage (as with OpenAI).
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage_ends_with_a_usage_chunk(client) -> None:
    chunks = list(client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_non_stream_and_stream(client) -> None:
    whole = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                      max_tokens=8, temperature=0)
    assert whole.choices[0].text and whole.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_models_list_and_get(client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["smollm2-135m-instruct"]
    assert client.models.retrieve("smollm2-135m-instruct").owned_by == "flatfare"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_ledger_records_each_request(stack, client) -> None:
    before = _ledger_count(stack)
    reply = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=5)
    request_id = reply.headers["x-request-id"]
    body = reply.parse()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = stack.sql("SELECT status, prompt_tokens, completion_tokens, model, endpoint, ttft_ms "
                         "FROM requests WHERE id = :id", id=request_id)
        if rows and rows[0][0] != "queued":
            break
        time.sleep(0.1)
    assert _ledger_count(stack) == before + 1
    status, prompt, completion, model, endpoint, ttft = rows[0]
    assert (status, model, endpoint) == ("succeeded", "smollm2-135m-instruct", "chat")
    assert (prompt, completion) == (body.usage.prompt_tokens, body.usage.completion_tokens)
    assert ttft is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "smollm2-135m-instruct"}, "messages"),
        ({"model": "smollm2-135m-instruct", "messages": "hi"}, "messages"),
        ({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": "ten"}, "max_tokens"),
        ({"model": "smollm2-135m-instruct", "messages": QUESTION, "temperature": 9}, "temperature"),
        ({"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 100_000}, "max_tokens"),
        ({"model": "smollm2-135m-instruct", "messages": QUESTION, "stream": "yes"}, "stream"),
        ({"messages": QUESTION}, "model"),
    ],
)
def test_bad_bodies_get_400_naming_the_param(stack, client, body, param) -> None:
    _wait_queue_empty(stack)  # the job of the test before, acknowledged after its answer
    before = _ledger_count(stack)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", body=body, cast_to=httpx.Response)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert _ledger_count(stack) == before and _queue_is_empty(stack)


def test_malformed_json_gets_400(stack) -> None:
    before = _ledger_count(stack)
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert _ledger_count(stack) == before and _queue_is_empty(stack)


def test_unknown_model_gets_404_model_not_found(stack, client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert _queue_is_empty(stack)


@pytest.mark.parametrize("key", [None, "sk-not-ours", "ff-" + "x" * 43])
def test_missing_or_wrong_key_gets_401(stack, key) -> None:
    before = _ledger_count(stack)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", headers=headers,
                          json={"model": "smollm2-135m-instruct", "messages": QUESTION})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert _ledger_count(stack) == before and _queue_is_empty(stack)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key or "none", max_retries=0).models.list()


def test_oversized_body_gets_413(stack) -> None:
    huge = "x" * (9 * 1024 * 1024)
    response = httpx.post(f"{stack.base_url}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {stack.api_key}"},
                          json={"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": huge}]})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert _queue_is_empty(stack)


def test_prompt_longer_than_context_is_refused_by_the_engine_cleanly(stack, client) -> None:
    long_prompt = "word " * 3000
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2-135m-instruct",
                                       messages=[{"role": "user", "content": long_prompt}], max_tokens=10)
    assert caught.value.body["message"]
    _wait_queue_empty(stack)


async def test_client_disconnect_mid_stream_frees_the_engine_slot(stack, aclient) -> None:
    stream = await aclient.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=1500, stream=True,
        extra_body={"ignore_eos": True})
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == 5:
            break
    deadline = time.monotonic() + 5  # the heartbeat reports inflight jobs once a second
    while not (busy := [w for w in _workers(stack) if w.inflight]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await stream.close()
    assert busy, "the request should have been running when the client left"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        workers = _workers(stack)
        if all(w.inflight == 0 and w.extra.get("engine_unfinished") == 0 for w in workers):
            break
        await asyncio.sleep(0.2)
    else:
        pytest.fail(f"engine slot still held after the client left: {workers}")
    deadline = time.monotonic() + 10  # the gateway closes the row after it told the worker to stop
    while (rows := stack.sql("SELECT status FROM requests ORDER BY created_at DESC LIMIT 1"))[0][0] == "queued":
        assert time.monotonic() < deadline, "the ledger row was never closed"
        await asyncio.sleep(0.1)
    assert rows[0][0] == "cancelled"
    assert _queue_is_empty(stack)
    # Its account's in-flight slot is given back too (the worker writes that with the job's end, just
    # after its heartbeat may already say it is idle): the next test sends as many as the plan allows.
    deadline = time.monotonic() + 10
    while not _nothing_in_flight(stack):
        assert time.monotonic() < deadline, "the request still counts in flight after the client left"
        await asyncio.sleep(0.1)


async def test_sixteen_concurrent_streams_all_complete(stack, aclient) -> None:
    async def one(i: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=32, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert len(results) == 16
    assert all(text and finish == "length" for text, finish in results)
    _wait_queue_empty(stack)


def test_health_and_readiness(stack) -> None:
    assert httpx.get(f"{stack.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.base_url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["models"] == {"smollm2-135m-instruct": "1 live worker(s)"}
