"""Metrics and logs of a running platform: scrape ``/metrics`` of the gateway (two processes) and of a
worker before and after real requests and check that every counter moved by exactly what was sent."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from flatfare import contract
from flatfare.contract import WorkerInfo
from tests.conftest import Stack, launch_stack
from tests.deploy.files import all_queries, selectors

pytestmark = pytest.mark.e2e

MODEL = "instant"
TOKENS = 16  # the instant engine's answer length
CHAT = "/v1/chat/completions"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls), _ in samples.items() if n == name]


def gateway_metrics(stack: Stack) -> Samples:
    response = httpx.get(f"{stack.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def worker_infos(stack: Stack, model: str) -> list[WorkerInfo]:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        ids = client.zrange(contract.pool_key(model), 0, -1)
        return [WorkerInfo.from_fields(client.hgetall(contract.worker_key(i.decode()))) for i in ids]
    finally:
        client.close()


def worker_metrics(stack: Stack, model: str) -> Samples:
    (info,) = worker_infos(stack, model)
    port = info.extra["metrics_port"]  # FLATFARE_METRICS_PORT=0: a free port, announced in the heartbeat
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return parse(response.text)


def new_key(stack: Stack, account: str, plan: str, limit: int | None = None) -> str:
    out = stack.cli("keys", "create", "--account", account, "--plan", plan)
    assert out.returncode == 0, out.stderr
    if limit is not None:
        stack.sql("UPDATE accounts SET daily_limit_override = :limit WHERE name = :name", limit=limit, name=account)
    return out.stdout.strip()


def wait_closed(stack: Stack, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.sql("SELECT count(*) FROM requests WHERE status = 'queued'")[0][0]:
        assert time.monotonic() < deadline, "ledger rows still open"
        time.sleep(0.05)


def log_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def eventually(read, ready, timeout_s: float = 10):
    """``read()`` once ``ready`` holds for it. What a request leaves behind is recorded a moment after its
    answer went out: the gateway counts, times and logs it once its bookkeeping (a background task) is
    done, and a worker counts a job and frees its slot after writing the reply."""
    deadline = time.monotonic() + timeout_s
    while not ready(result := read()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


@pytest.fixture(scope="module")
def mstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"FLATFARE_AUTH_CACHE_TTL_S": "0.1", "FLATFARE_PLANS_CACHE_TTL_S": "0.1"}
    with launch_stack(tmp_path_factory.mktemp("metrics"), model=MODEL, worker_args=("--engine", "instant"),
                      gateway_processes=2, env=env) as stack:
        # The seeded plans sell flat (migration 0010): give them a per-request price, so the outbox gauges
        # have meter events to count.
        stack.sql("UPDATE plans SET price_per_request_micros = 2000 WHERE name IN ('pro', 'premium')")
        yield stack


def test_counters_move_with_real_requests_through_two_gateway_processes(mstack: Stack) -> None:
    pro = new_key(mstack, "metrics-pro", "pro")
    premium = new_key(mstack, "metrics-premium", "premium")
    limited = new_key(mstack, "metrics-limited", "pro", limit=1)
    gw_before, wk_before = gateway_metrics(mstack), worker_metrics(mstack, MODEL)

    sent = {"pro": 0, "premium": 0}
    for i in range(6):
        client = openai.OpenAI(base_url=f"{mstack.base_url}/v1", api_key=pro if i % 2 else premium, max_retries=0)
        messages = [{"role": "user", "content": f"hello {i}"}]
        if i % 3 == 0:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
            assert chunks
        else:
            assert client.chat.completions.create(model=MODEL, messages=messages).choices
        sent["pro" if i % 2 else "premium"] += 1
    assert httpx.post(f"{mstack.base_url}{CHAT}", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                      headers={"Authorization": f"Bearer {limited}"}).status_code == 200
    refused = httpx.post(f"{mstack.base_url}{CHAT}", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                         headers={"Authorization": f"Bearer {limited}"})
    assert refused.status_code == 429
    assert httpx.post(f"{mstack.base_url}{CHAT}", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    wait_closed(mstack)

    # Each scrape may be answered by either gateway process: every one must show the sum of both.
    answered = sum(sent.values()) + 3  # the limited key's 200 and 429, and the 401
    for _ in range(4):
        # Wait until every request above, and the scrape before, has been recorded (see ``eventually``).
        gw = eventually(lambda: gateway_metrics(mstack), lambda s: value(s, "flatfare_requests_in_progress") == 1
                        and value(s, "flatfare_request_duration_seconds_count", route=CHAT)
                        - value(gw_before, "flatfare_request_duration_seconds_count", route=CHAT) >= answered)

        def moved(name: str, **labels: str) -> float:
            return value(gw, name, **labels) - value(gw_before, name, **labels)

        ok = {"route": CHAT, "status": "200", "model": MODEL}
        assert moved("flatfare_requests_total", **ok, plan="pro") == sent["pro"] + 1
        assert moved("flatfare_requests_total", **ok, plan="premium") == sent["premium"]
        assert moved("flatfare_requests_total", route=CHAT, status="429", plan="pro") == 1
        assert moved("flatfare_requests_total", route=CHAT, status="401") == 1
        assert moved("flatfare_quota_rejections_total", plan="pro") == 1
        total = sum(sent.values()) + 1
        # The 429 was routed (model known) before its quota check refused it.
        assert moved("flatfare_request_duration_seconds_count", route=CHAT, model=MODEL) == total + 1
        assert moved("flatfare_time_to_first_token_seconds_count", model=MODEL, lane="premium") == sent["premium"]
        assert moved("flatfare_time_to_first_token_seconds_count", model=MODEL, lane="standard") == sent["pro"] + 1
        assert moved("flatfare_queue_wait_seconds_count", model=MODEL) == total
        assert moved("flatfare_completions_total", model=MODEL, outcome="succeeded") == total
        assert moved("flatfare_output_tokens_total", model=MODEL) == total * TOKENS
        assert moved("flatfare_output_tokens_total", model=MODEL, lane="premium") == sent["premium"] * TOKENS
        assert value(gw, "flatfare_requests_in_progress") == 1  # this scrape itself

    wk = eventually(lambda: worker_metrics(mstack, MODEL),
                    lambda s: value(s, "flatfare_worker_inflight_jobs", model=MODEL) == 0)
    assert value(wk, "flatfare_worker_jobs_total", model=MODEL, outcome="succeeded") \
        - value(wk_before, "flatfare_worker_jobs_total", model=MODEL, outcome="succeeded") == total
    assert value(wk, "flatfare_worker_output_tokens_total", model=MODEL) \
        - value(wk_before, "flatfare_worker_output_tokens_total", model=MODEL) == total * TOKENS
    for lane, jobs in (("standard", sent["pro"] + 1), ("premium", sent["premium"])):  # each plan's lane
        assert value(wk, "flatfare_worker_queue_wait_seconds_count", model=MODEL, lane=lane) \
            - value(wk_before, "flatfare_worker_queue_wait_seconds_count", model=MODEL, lane=lane) == jobs
    assert value(wk, "flatfare_worker_capacity", model=MODEL) > 0
    assert value(wk, "flatfare_worker_inflight_jobs", model=MODEL) == 0
    assert value(wk, "flatfare_worker_draining", model=MODEL) == 0


def test_queue_pool_and_outbox_gauges(mstack: Stack) -> None:
    client = redis_sync.Redis.from_url(mstack.redis_url)
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    stream = contract.job_stream(ghost)
    try:
        # A pinned model with no worker, two queued jobs, one of them taken by a consumer of the group.
        mstack.sql("INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers, created_at) "
                   "VALUES (:n, 'none', '{}', true, true, 1, CURRENT_TIMESTAMP)", n=ghost)
        client.xgroup_create(stream, contract.POOL_GROUP, id="0", mkstream=True)
        for request_id in ("a", "b", "c"):
            client.xadd(stream, {"id": request_id})
        client.xreadgroup(contract.POOL_GROUP, "test-consumer", {stream: ">"}, count=1)
        time.sleep(0.3)
        gw = gateway_metrics(mstack)
    finally:
        client.delete(stream)
        client.close()
        mstack.sql("DELETE FROM models WHERE name = :n", n=ghost)
    assert value(gw, "flatfare_queue_depth", model=ghost, lane="standard") == 2
    assert value(gw, "flatfare_queue_claimed", model=ghost, lane="standard") == 1
    assert 0.2 <= value(gw, "flatfare_queue_oldest_wait_seconds", model=ghost, lane="standard") < 60
    assert {"model": ghost, "pinned": "true"} in series(gw, "flatfare_pool_live_workers")
    assert value(gw, "flatfare_pool_live_workers", model=ghost) == 0
    assert value(gw, "flatfare_pool_min_workers", model=ghost) == 1
    assert value(gw, "flatfare_pool_live_workers", model=MODEL, pinned="false") == 1
    assert value(gw, "flatfare_queue_depth", model=MODEL, lane="standard") == 0
    # Billing is off in this stack, so every priced request's meter event waits in the outbox.
    pending = mstack.sql("SELECT count(*) FROM usage_outbox WHERE status = 'pending'")[0][0]
    assert pending > 0 and value(gw, "flatfare_billing_outbox_pending") == pending
    assert value(gw, "flatfare_billing_outbox_oldest_age_seconds") > 0
    assert value(gw, "flatfare_dependency_up", dependency="redis") == 1
    assert value(gw, "flatfare_dependency_up", dependency="database") == 1


def test_logs_are_json_lines_with_request_fields_and_no_secrets(mstack: Stack) -> None:
    key = new_key(mstack, "metrics-logs", "pro")
    secret_prompt = f"my secret prompt {uuid.uuid4().hex}"
    response = httpx.post(f"{mstack.base_url}{CHAT}", json={"model": MODEL, "messages": [
        {"role": "user", "content": secret_prompt}]}, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    wait_closed(mstack)
    # The request's line is written once its bookkeeping is done, after the answer went out.
    gateway_log = eventually(lambda: log_lines(mstack.logs / "gateway.log"),
                             lambda lines: any(request_id in line and '"route"' in line for line in lines))
    records = [json.loads(line) for line in gateway_log]  # every line is one JSON object
    mine = [r for r in records if r.get("request_id") == request_id]
    assert mine, "no log line names the request"
    line = mine[-1]
    assert (line["account"], line["model"], line["status"], line["route"]) == ("metrics-logs", MODEL, 200, CHAT)
    assert {"time", "level", "logger", "message"} <= set(line)
    for path in (mstack.logs / "gateway.log", mstack.logs / "worker.log"):
        text = path.read_text()
        assert key not in text and key[11:] not in text
        assert mstack.api_key not in text
        assert secret_prompt not in text
    for line in log_lines(mstack.logs / "worker.log"):
        json.loads(line)


def test_vllm_engine_metrics_from_the_cpu_worker(stack: Stack) -> None:
    """The shared real-engine stack: vLLM's own metrics on the worker's /metrics, and no stats lines."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    before = worker_metrics(stack, stack.model)
    reply = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8, temperature=0)
    labels = {"model_name": stack.model}
    # The worker counts the job after writing its reply, and vLLM its tokens after handing them out.
    after = eventually(lambda: worker_metrics(stack, stack.model), lambda s: all(
        value(s, name, **match) - value(before, name, **match) >= reply.usage.completion_tokens
        for name, match in (("vllm:generation_tokens_total", labels),
                            ("flatfare_worker_output_tokens_total", {"model": stack.model}))))
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert series(after, gauge), f"{gauge} is not exported"
    assert value(after, "vllm:generation_tokens_total", **labels) \
        - value(before, "vllm:generation_tokens_total", **labels) == reply.usage.completion_tokens
    assert value(after, "flatfare_worker_output_tokens_total", model=stack.model) \
        - value(before, "flatfare_worker_output_tokens_total", model=stack.model) == reply.usage.completion_tokens
    # Every vLLM metric the dashboard and the alerts use is really there.
    scraped = {name for name, _ in after}
    for expr in all_queries():
        for name, _ in selectors(expr):
            if name.startswith("vllm:"):
                assert name in scraped, f"{name} ({expr!r}) is not exported by the running vLLM"
    worker_log = (stack.logs / "worker.log").read_text()
    assert "Avg prompt throughput" not in worker_log  # vLLM's periodic stats lines stay off
    gateway = gateway_metrics(stack)
    assert value(gateway, "flatfare_pool_live_workers", model=stack.model) == 1
