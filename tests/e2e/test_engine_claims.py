"""What README and docs/ARCHITECTURE.md claim about vLLM, proven on the real CPU engine (SmolLM2-135M-Instruct)
through the whole path: gateway -> Redis -> worker -> vLLM, the official ``openai`` SDK as the client.

The shared ``stack`` (tests/conftest.py) serves the claims its settings fit (structured output, the
engine after hostile input). The others need workers started differently; they share ONE extra stack
(``estack``): a worker whose engine runs one sequence at a time (``max_num_seqs`` 1) but which holds up
to eight jobs, so requests wait *inside* the engine, and a short job lease for a quick takeover. Its
second worker (``pair``) joins for prefix routing and the kill, so the priority tests come first.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
import jsonschema
import openai
import psutil
import pytest
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from flatfare.contract import Endpoint, Lane, WorkerInfo, WorkerState
from flatfare.gateway.jobpath.prefix_routing import prefix_hash
from tests.conftest import Stack, launch_stack
from tests.security.test_http import BAD_BODIES
from tests.security.test_limits import json_schema, nested
from tests.security.test_media import data_url, png

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The engine runs one sequence at a time and the worker holds eight jobs: the rest wait in vLLM's own
# queue, where only its scheduling policy orders them. The lease is short so a dead worker's job is
# taken over within seconds (renewed every lease/3, so a live worker keeps it even on a slow machine).
ESTACK_ENV = {"FLATFARE_ENGINE_OPTIONS": '{"enforce_eager": true, "max_num_seqs": 1}', "FLATFARE_JOB_LEASE_S": "4"}
ESTACK_WORKER_ARGS = ("--max-inflight", "8")
T = TypeVar("T")


def eventually(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 60, what: str = "") -> T:
    """``read()`` until ``ok`` holds, up to a deadline."""
    deadline = time.monotonic() + timeout_s
    while not ok(value := read()):
        assert time.monotonic() < deadline, f"never {what or 'true'}: last {value!r}"
        time.sleep(0.1)
    return value


async def aeventually(read: Callable[[], T], ok: Callable[[T], bool], timeout_s: float = 60, what: str = "") -> T:
    deadline = time.monotonic() + timeout_s
    while not ok(value := await asyncio.to_thread(read)):
        assert time.monotonic() < deadline, f"never {what or 'true'}: last {value!r}"
        await asyncio.sleep(0.1)
    return value


def new_key(stack: Stack, account: str, plan: str) -> str:
    out = stack.cli("keys", "create", "--account", account, "--plan", plan)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def live_workers(stack: Stack) -> list[WorkerInfo]:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        oldest = int(time.time() * 1000 - contract.WORKER_TTL_S * 1000)
        ids = client.zrangebyscore(contract.pool_key(MODEL), oldest, "+inf")
        infos = [WorkerInfo.from_fields(f) for f in (client.hgetall(contract.worker_key(i.decode())) for i in ids) if f]
        return [w for w in infos if w.state == WorkerState.WARM]
    finally:
        client.close()


def worker_of(stack: Stack, pid: int) -> WorkerInfo:
    return next(w for w in live_workers(stack) if f"-{pid}-" in w.worker_id)


def engine_metrics(worker: WorkerInfo) -> dict[str, float]:
    """The worker's own /metrics (vLLM's engine metrics among them), summed over labels per sample name."""
    response = httpx.get(f"http://127.0.0.1:{worker.extra['metrics_port']}/metrics", timeout=10)
    assert response.status_code == 200
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("model_name", MODEL) == MODEL:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def quota_used(stack: Stack, account: str) -> int:
    account_id = stack.sql("SELECT id FROM accounts WHERE name = :name", name=account)[0][0]
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return int(client.get(counter_key(account_id, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()


def kill_tree(pid: int) -> None:
    """kill -9 a worker and its engine processes (vLLM's engine core is a child, its CPU worker a grandchild)."""
    parent = psutil.Process(pid)
    for process in [parent, *parent.children(recursive=True)]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def estack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(tmp_path_factory.mktemp("engine-claims"), worker_args=ESTACK_WORKER_ARGS, env=ESTACK_ENV) as s:
        s.premium_key = new_key(s, "vip", "premium")  # type: ignore[attr-defined]
        yield s


@pytest.fixture(scope="module")
def pair(estack: Stack) -> Iterator[subprocess.Popen[bytes]]:
    """A second real-engine worker of the model in ``estack``, warm."""
    log = (estack.logs / "worker-2.log").open("wb")
    second = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--model", MODEL, *ESTACK_WORKER_ARGS],
                              env=estack.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: [w.worker_id for w in live_workers(estack)], lambda ids: len(ids) == 2, timeout_s=600,
                   what="two warm workers")
        yield second
    finally:
        second.terminate()  # drains (nothing is left to run) and shuts its engine down
        try:
            second.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(second.pid)
            second.wait()
        log.close()


# -- 1. premium overtakes standard inside one engine (vLLM priority scheduling) ---------------

@pytest.mark.parametrize("late_plan", ["premium", "standard"])
async def test_a_premium_request_starts_before_standard_ones_queued_earlier_in_the_engine(
        estack: Stack, late_plan: str) -> None:
    """The engine runs one sequence; a long one holds it, three standard requests wait behind it in
    vLLM's queue, then a late request arrives. Premium (priority 0) is started first when the slot
    frees; the same late request on the standard lane (priority 10) waits for the three (the control:
    arrival order alone would put it last)."""
    assert len(live_workers(estack)) == 1, "the priority tests need the engine-claims stack's single worker"
    worker = live_workers(estack)[0]
    late_key = estack.premium_key if late_plan == "premium" else estack.api_key  # type: ignore[attr-defined]
    order: list[str] = []

    def waiting() -> tuple[float, float]:
        metrics = engine_metrics(worker)
        return metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"]

    async def one(name: str, key: str) -> None:
        sdk = openai.AsyncOpenAI(base_url=f"{estack.base_url}/v1", api_key=key, max_retries=0, timeout=300)
        stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": name}],
                                                   max_tokens=16, stream=True, extra_body={"ignore_eos": True})
        async for _chunk in stream:
            if name not in order:
                order.append(name)  # its first output: the engine started it
        await sdk.close()

    blocker_sdk = openai.AsyncOpenAI(base_url=f"{estack.base_url}/v1", api_key=estack.api_key, max_retries=0,
                                     timeout=300)
    blocker = await blocker_sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a very long story."}], max_tokens=1500,
        stream=True, extra_body={"ignore_eos": True})
    await anext(blocker)  # running: the engine's only slot is taken
    queued = [asyncio.ensure_future(one(f"standard {i}", estack.api_key)) for i in range(3)]
    await aeventually(waiting, lambda rw: rw == (1, 3), what="one running and three waiting in the engine")
    late = asyncio.ensure_future(one("late", late_key))
    await aeventually(waiting, lambda rw: rw == (1, 4), what="the late request waiting in the engine too")
    await blocker.close()  # the client leaves: the engine aborts it and frees the slot
    await blocker_sdk.close()
    await asyncio.wait_for(asyncio.gather(*queued, late), timeout=300)
    assert sorted(order) == sorted(["late", "standard 0", "standard 1", "standard 2"])
    if late_plan == "premium":
        assert order[0] == "late", order
    else:
        assert order[-1] == "late", order


# -- 2. a prefix-routed request hits vLLM's prefix cache on the worker that owns it --------------

def test_a_prefix_routed_request_hits_the_owning_workers_prefix_cache(
        estack: Stack, pair: subprocess.Popen[bytes]) -> None:
    sdk = openai.OpenAI(base_url=f"{estack.base_url}/v1", api_key=estack.api_key, max_retries=0, timeout=300)
    # ~450 tokens shared: several of the engine's KV blocks, which is what its prefix cache reuses.
    system = {"role": "system", "content": "You answer questions about this contract. " + " ".join(
        f"Clause {i}: the supplier delivers item {i} within {i + 2} days." for i in range(30))}
    body = {"model": MODEL, "messages": [system, {"role": "user", "content": "q0"}]}
    sdk.chat.completions.create(**body, max_tokens=2)
    redis = redis_sync.Redis.from_url(estack.redis_url)
    try:
        owner = redis.get(contract.prefix_key(MODEL, prefix_hash(Endpoint.CHAT, body)))
        assert owner is not None, "the worker that ran the first request did not record itself as the prefix's owner"
        owner_id = owner.decode()
        workers = {w.worker_id: w for w in live_workers(estack)}
        assert len(workers) == 2 and owner_id in workers
        (other_id,) = set(workers) - {owner_id}
        own_stream = contract.worker_stream(MODEL, owner_id)

        def routed() -> int:
            return redis.xinfo_stream(own_stream)["entries-added"] if redis.exists(own_stream) else 0

        before = {w: engine_metrics(workers[w]) for w in workers}
        routed_before = routed()
        for i in range(1, 4):
            sdk.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": f"q{i}"}],
                                        max_tokens=2)
        assert routed() - routed_before == 3  # each went to the owner's own stream, not to the lane

        def delta(worker_id: str, name: str) -> float:
            return engine_metrics(workers[worker_id])[name] - before[worker_id][name]

        # vLLM counts a request's prefix-cache query and hits once it has scheduled it.
        eventually(lambda: delta(owner_id, "vllm:prefix_cache_queries_total"), lambda q: q > 0,
                   what="the owner counted the requests' prefix-cache queries")
        hits = delta(owner_id, "vllm:prefix_cache_hits_total")
        queries = delta(owner_id, "vllm:prefix_cache_queries_total")
        assert hits >= queries / 2 > 0, (hits, queries)  # most of each prompt came from the owner's cache
        assert delta(other_id, "vllm:prefix_cache_queries_total") == 0  # the other worker saw none of them
    finally:
        redis.close()
        sdk.close()


# -- 3. kill -9 of a real-engine worker mid-stream ---------------------------------------------

def test_a_worker_killed_mid_stream_ends_the_stream_cleanly_and_the_ledger_and_quota_agree(
        estack: Stack, pair: subprocess.Popen[bytes]) -> None:
    """Documented: a job whose worker died after part of its answer went out is taken over by a live
    worker and failed cleanly with ``worker_lost`` (not run again); one ledger row, and the quota unit
    is kept exactly when the row is billable."""
    assert len(live_workers(estack)) == 2, "the takeover needs a second live worker"
    key = new_key(estack, "killed-mid-stream", "pro")
    sdk = openai.OpenAI(base_url=f"{estack.base_url}/v1", api_key=key, max_retries=0, timeout=300)
    redis = redis_sync.Redis.from_url(estack.redis_url)
    try:
        response = sdk.chat.completions.with_streaming_response.create(
            model=MODEL, messages=QUESTION, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
        with response as raw:
            request_id = raw.headers["x-request-id"]
            chunks = raw.parse()
            seen = [next(chunks), next(chunks)]  # output is flowing
            held = redis.xpending_range(contract.job_stream(MODEL, Lane.STANDARD), contract.POOL_GROUP, "-", "+", 10)
            assert len(held) == 1
            holder = held[0]["consumer"].decode()
            kill_tree(int(holder.split("-")[-2]))
            with pytest.raises(openai.APIError) as caught:
                seen.extend(chunks)
        assert caught.value.body["code"] == "worker_lost", caught.value.body
        assert all(c.choices[0].finish_reason is None for c in seen if c.choices)  # it never claimed to finish

        def row() -> list[tuple]:
            return estack.sql("SELECT status, billable, error_code, price_micros FROM requests WHERE id = :id",
                              id=request_id)

        (status, billable, error_code, price) = eventually(row, lambda r: r and r[0][0] != "queued",
                                                           what="the ledger row closed")[0]
        assert (status, error_code) == ("failed", "worker_lost")
        assert estack.sql("SELECT count(*) FROM requests WHERE account_id = (SELECT id FROM accounts "
                          "WHERE name = 'killed-mid-stream')")[0][0] == 1
        assert quota_used(estack, "killed-mid-stream") == int(billable)  # charged <=> billable; else given back
        outbox = estack.sql("SELECT count(*) FROM usage_outbox WHERE request_id = :id", id=request_id)[0][0]
        assert outbox == int(bool(billable) and price > 0)
    finally:
        redis.close()
        sdk.close()


# -- 4. the engine answers correctly after the hostile-input suite ------------------------------

# Bodies that pass the gateway's caps and reach the engine, the edges of what it lets through, each with
# the status the engine answers (None: 400 while the default model's worker has no tool-call parser).
ENGINE_EDGES: dict[str, tuple[dict[str, Any], int | None]] = {
    "regex harmless to an automaton": ({"structured_outputs": {"regex": "(a|aa)*b"}}, 200),
    "schema just under the size cap": ({"response_format": json_schema(nested(8))}, 200),
    "nested arrays": ({"response_format": json_schema(
        {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}})}, 200),
    "logit_bias and top_logprobs at their caps": ({"logit_bias": {str(i): -1 for i in range(300)}, "logprobs": True,
                                                   "top_logprobs": 20, "stop": ["s1", "s2", "s3", "s4"]}, 200),
    "control characters": ({"messages": [{"role": "user", "content": "\x00\x1b[2J\u202e\ufeff" * 50}]}, 200),
    "128 tools": ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                             for i in range(128)]}, None),
    "an image to a text-only model": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": data_url(png(8, 8))}}]}]},
        400),
    "a prompt past the context": ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
}


def test_the_engine_answers_correctly_after_the_hostile_input_suite(stack: Stack, client: openai.OpenAI) -> None:
    auth = {"Authorization": f"Bearer {stack.api_key}"}
    refused: dict[str, int] = {}
    answered: dict[str, int] = {}
    with httpx.Client(base_url=stack.base_url, headers=auth, timeout=300) as http:
        for case, (body, _param, _code) in BAD_BODIES.items():  # tests/security's, now on the real engine's stack
            refused[case] = http.post("/v1/chat/completions", json={**body, "model": MODEL}).status_code
        for case, (fields, _status) in ENGINE_EDGES.items():
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **fields}
            answered[case] = http.post("/v1/chat/completions", json=body).status_code
    assert set(refused.values()) == {400}, refused
    for case, (_fields, status) in ENGINE_EDGES.items():  # answered or refused as expected, never a 5xx
        assert answered[case] in ((status,) if status else (200, 400)), (case, answered)
    assert stack.worker.poll() is None
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in reply.choices[0].message.content


# -- 5. JSON mode, structured output and tools through the SDK --------------------------------

def test_json_mode_returns_json(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=200, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Tell me about Paris in one sentence."}])  # prose without JSON mode
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


# Every value bounded: a 135M model may repeat a digit forever in an unbounded integer.
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "country": {"type": "string", "maxLength": 30},
                                                "is_capital": {"type": "boolean"}},
               "required": ["city", "country", "is_capital"], "additionalProperties": False}


def test_a_json_schema_response_validates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=100, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY_SCHEMA)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


# The default model's catalog entry sets the Hermes tool-call parser (migration 0006); every mode,
# streamed and not, is in tests/e2e/test_function_calling.py.
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_parses(client: openai.OpenAI, tool_choice: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=100, tools=[WEATHER_TOOL], tool_choice=tool_choice,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
