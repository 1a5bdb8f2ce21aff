"""Metrics, logs and traces of a running platform: scrape ``/metrics`` of the gateway (two processes) and of a
worker before and after real requests and check that every counter moved by exactly what was sent; every
request's spans reach an OTLP receiver as one trace (tests/otlp_receiver.py)."""

from __future__ import annotations

import json
import socket
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
from tests.batches.helpers import chat_lines, start_batch, wait_for
from tests.conftest import Stack, launch_stack
from tests.deploy.files import all_queries, selectors
from tests.otlp_receiver import OTLPReceiver, ReceivedSpan, otlp_receiver, tree

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
def receiver() -> Iterator[OTLPReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def mstack(tmp_path_factory: pytest.TempPathFactory, receiver: OTLPReceiver) -> Iterator[Stack]:
    # The ledger's checks read at every scrape, so each test sees its own requests at once.
    env = {"FLATFARE_AUTH_CACHE_TTL_S": "0.1", "FLATFARE_PLANS_CACHE_TTL_S": "0.1", "FLATFARE_METRICS_LEDGER_EVERY_S": "0",
           # Every request traced to the receiver (flatfare/tracing.py), exported within 0.1 s (the SDK's
           # batch delay: OTEL_BSP_SCHEDULE_DELAY).
           "FLATFARE_TRACES_ENDPOINT": receiver.url, "FLATFARE_TRACES_SAMPLE_RATIO": "1",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with launch_stack(tmp_path_factory.mktemp("metrics"), model=MODEL, worker_args=("--engine", "instant"),
                      gateway_processes=2, env=env,
                      # The seeded plans sell flat (migration 0010): give them a per-request price, so the
                      # outbox gauges have meter events to count.
                      before_start=("UPDATE plans SET price_per_request_micros = 2000 "
                                    "WHERE name IN ('pro', 'premium')",)) as stack:
        yield stack


def test_an_idle_connection_outlives_the_clients_own_idle_limit(mstack: Stack) -> None:
    """httpx and the OpenAI SDKs drop a connection idle for 5 s; uvicorn's default closed it at 5 s too, so a
    client could send on a connection the gateway was closing and fail with a connection error (a cause of
    the soak's lost requests). The gateway keeps it FLATFARE_KEEP_ALIVE_S (65 s): one idle 6 s still answers."""
    port = int(mstack.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        reader = conn.makefile("rb")
        for idle_s in (6, 0):
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), f"the gateway closed the idle connection: {status!r}"
            headers = dict(line.split(b":", 1) for line in iter(reader.readline, b"\r\n"))
            reader.read(int(headers[b"content-length"]))
            time.sleep(idle_s)


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


def test_each_plans_promise_is_measured_per_plan_and_lane(mstack: Stack) -> None:
    """The series the plan dashboard and its alerts read move with real requests: a premium request lands
    in the premium plan's and lane's histograms, a quota 429 and a 401 are counted by their error code,
    batch lines are counted done, and each plan's target, use today and the ledger's checks are there."""
    premium = new_key(mstack, "promise-premium", "premium")
    limited = new_key(mstack, "promise-limited", "pro", limit=1)
    before = gateway_metrics(mstack)
    sdk = openai.OpenAI(base_url=f"{mstack.base_url}/v1", api_key=premium, max_retries=0)
    list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers={"Authorization": f"Bearer {limited}"}) \
        .status_code == 200
    refused = httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers={"Authorization": f"Bearer {limited}"})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers={"Authorization": "Bearer nope"}) \
        .status_code == 401
    batch = start_batch(sdk, chat_lines(MODEL, 2))
    assert wait_for(sdk, batch.id, "completed", timeout_s=60).request_counts.completed == 2
    wait_closed(mstack)

    def moved(after: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    gw = eventually(lambda: gateway_metrics(mstack), lambda s: moved(
        s, "flatfare_queue_wait_seconds_count", plan="pro") >= 1 and moved(
        s, "flatfare_batch_lines_total", model=MODEL, outcome="done") >= 2)
    premium_lane = {"model": MODEL, "lane": "premium", "plan": "premium"}
    assert moved(gw, "flatfare_time_to_first_token_seconds_count", **premium_lane) == 1
    assert moved(gw, "flatfare_queue_wait_seconds_count", **premium_lane) == 1
    assert moved(gw, "flatfare_time_to_first_token_seconds_count", plan="premium", lane="standard") == 0
    assert moved(gw, "flatfare_time_to_first_token_seconds_count", model=MODEL, lane="standard", plan="pro") == 1
    assert moved(gw, "flatfare_refusals_total", plan="pro", status="429", code="rate_limit_exceeded") == 1
    assert moved(gw, "flatfare_refusals_total", status="401", code="invalid_api_key") == 1
    assert moved(gw, "flatfare_refusals_total", plan="premium") == 0
    assert moved(gw, "flatfare_batch_lines_total", model=MODEL, outcome="done") == 2
    assert moved(gw, "flatfare_batch_lines_total", outcome="failed") == 0
    # Each plan's promise beside its figures, and its use today (the limited key's and the premium ones).
    assert value(gw, "flatfare_plan_ttft_target_seconds", plan="premium") == 5.0
    assert value(gw, "flatfare_plan_queue_wait_target_seconds", plan="premium") == 2.0
    assert value(gw, "flatfare_plan_daily_limit_requests", plan="pro") == 1000
    # The stream's unit; the batch lines count on their own allowance, the 429 counted nothing.
    assert moved(gw, "flatfare_plan_quota_used_requests", plan="premium") == 1
    assert moved(gw, "flatfare_plan_quota_used_requests", plan="pro") == 1
    # The instant engine is warm, nothing is lost, the ledger and the meter agree.
    assert value(gw, "flatfare_pool_warm_workers", model=MODEL) == 1
    assert value(gw, "flatfare_ledger_stuck_requests") == 0
    assert value(gw, "flatfare_billing_ledger_meter_mismatch", kind="unmetered") == 0
    assert value(gw, "flatfare_billing_ledger_meter_mismatch", kind="overmetered") == 0
    assert value(gw, "flatfare_requests_lost_total") == 0


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


def test_a_clients_traceparent_is_continued_in_the_answer_and_every_log_line(mstack: Stack) -> None:
    key = new_key(mstack, "metrics-trace", "pro")
    trace_id = uuid.uuid4().hex
    sent = f"00-{trace_id}-00f067aa0ba902b7-01"
    auth = {"Authorization": f"Bearer {key}", "traceparent": sent}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}]}
    answers = [httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers=auth),
               httpx.post(f"{mstack.base_url}{CHAT}", json={**body, "stream": True}, headers=auth),
               httpx.get(f"{mstack.base_url}/v1/models", headers=auth),  # a FastAPI route
               httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers={**auth, "Authorization": "Bearer nope"})]
    assert [a.status_code for a in answers] == [200, 200, 200, 401]
    spans = set()
    for answer in answers:  # the client's trace, under a span of the gateway's own for each request
        version, returned_trace, span, flags = answer.headers["traceparent"].split("-")
        assert (version, returned_trace, flags) == ("00", trace_id, "01") and span != "00f067aa0ba902b7"
        spans.add(span)
    assert len(spans) == len(answers)
    # Without one (or with one that is not valid), each request starts a trace of its own.
    fresh = [httpx.post(f"{mstack.base_url}{CHAT}", json=body, headers={"Authorization": f"Bearer {key}",
                                                                        **extra}).headers["traceparent"]
             for extra in ({}, {"traceparent": "00-xyz"})]
    assert len({t.split("-")[1] for t in fresh} | {trace_id}) == 3
    wait_closed(mstack)
    ids = {answers[0].headers["x-request-id"], answers[1].headers["x-request-id"]}
    lines = eventually(lambda: [json.loads(line) for line in log_lines(mstack.logs / "gateway.log")],
                       lambda records: sum(r.get("request_id") in ids and "route" in r for r in records) >= 2)
    mine = [r for r in lines if r.get("request_id") in ids or r.get("trace_id") == trace_id]
    assert len(mine) >= 3  # the two completions and the models list, at least one line each
    for record in mine:
        assert record["trace_id"] == trace_id and record["span_id"] in spans, record


def worker_records(stack: Stack, request_ids: set[str], each: int = 1) -> list[dict]:
    """The worker's log lines of ``request_ids``, once each request has at least ``each`` (the worker writes a
    job's last line just after its reply)."""
    def read() -> list[dict]:
        return [r for r in map(json.loads, log_lines(stack.logs / "worker.log")) if r.get("request_id") in request_ids]

    return eventually(read, lambda records: all(sum(r["request_id"] == i for r in records) >= each
                                                for i in request_ids))


def test_the_worker_logs_each_job_under_the_trace_of_its_request(mstack: Stack) -> None:
    """The job carries the gateway's span: the worker's lines for it are in the client's trace, under a span
    of the worker's own; a batch line is in the trace of the request that created its batch, if any."""
    key = new_key(mstack, "metrics-trace-worker", "pro")
    trace_id = uuid.uuid4().hex
    auth = {"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "trace me through the worker"}]}
    answers = [httpx.post(f"{mstack.base_url}{CHAT}", json={**body, "stream": stream}, headers=auth)
               for stream in (False, True)]
    assert [a.status_code for a in answers] == [200, 200]
    gateway_spans = {a.headers["traceparent"].split("-")[2] for a in answers}
    records = worker_records(mstack, {a.headers["x-request-id"] for a in answers})
    assert {r["message"].split(":")[0] for r in records} >= {f"answered {a.headers['x-request-id']}" for a in answers}
    for record in records:
        assert record["trace_id"] == trace_id, record
        assert len(record["span_id"]) == 16 and record["span_id"] not in gateway_spans | {"00f067aa0ba902b7"}
    assert len({r["span_id"] for r in records}) == len(answers)  # one span of the worker's per job

    # A batch's lines run in the trace of the request that created it, a span of the worker's each: the
    # client's, or the one the gateway started and named in the answer's traceparent.
    sdk = openai.OpenAI(base_url=f"{mstack.base_url}/v1", api_key=key, max_retries=0)
    traced = start_batch(sdk, chat_lines(MODEL, 2), extra_headers={"traceparent": auth["traceparent"]})
    uploaded = sdk.files.create(file=("requests.jsonl", chat_lines(MODEL, 2)), purpose="batch")
    created = sdk.batches.with_raw_response.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    untraced, its_trace = created.parse(), created.headers["traceparent"].split("-")[1]
    assert its_trace != trace_id
    for batch, expected in ((traced, trace_id), (untraced, its_trace)):
        assert wait_for(sdk, batch.id, "completed", timeout_s=60).request_counts.completed == 2
        lines = worker_records(mstack, {contract.batch_request_id(batch.id, i) for i in range(2)})
        assert {r["trace_id"] for r in lines} == {expected}
        spans = {r["span_id"] for r in lines}
        assert len(spans) == 2 and not spans & gateway_spans  # a span of the worker's per line


def _spans_of(receiver: OTLPReceiver, trace_id: str, *names: str) -> list[ReceivedSpan]:
    """The trace's spans once each of ``names`` has arrived (each process exports in the background)."""
    return [s for s in receiver.wait(lambda spans: set(names) <= {s.name for s in spans if s.trace_id == trace_id})
            if s.trace_id == trace_id]


def test_each_request_is_one_connected_trace_across_the_gateway_and_the_worker(mstack: Stack,
                                                                             receiver: OTLPReceiver) -> None:
    """Flatfare's spans over OTLP: a whole and a streamed answer, a refusal and a batch line are each one
    trace, the gateway's and the worker's spans connected through the job's traceparent."""
    key = new_key(mstack, "metrics-spans", "pro")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "span me"}]}
    client_span = "00f067aa0ba902b7"
    # Probes and scrapes are not traced, even when asked to be: one of each per load balancer and Prometheus
    # every few seconds would bury the requests' traces.
    probes = {path: uuid.uuid4().hex for path in ("/healthz", "/metrics")}
    for path, probe_trace in probes.items():
        assert httpx.get(f"{mstack.base_url}{path}", headers={"traceparent": f"00-{probe_trace}-{client_span}-01"}).is_success
    answers = {stream: httpx.post(f"{mstack.base_url}{CHAT}", json={**body, "stream": stream}, headers={
        **auth, "traceparent": f"00-{uuid.uuid4().hex}-{client_span}-01"}) for stream in (False, True)}
    for stream, answer in answers.items():
        assert answer.status_code == 200
        _, trace_id, gateway_span, flags = answer.headers["traceparent"].split("-")
        spans = _spans_of(receiver, trace_id, "ledger write", "settlement", "relay", "job", "engine run",
                          "lane wait", "admission")
        root = tree(spans)  # one trace: the gateway's request span under the client's, all else beneath
        assert (root.name, root.span_id, root.parent_id, root.service) == (
            f"POST {CHAT}", gateway_span, client_span, "flatfare-gateway")
        assert root.attributes["http.response.status_code"] == 200 and flags == "01"
        assert root.attributes["flatfare.request_id"] == answer.headers["x-request-id"]
        by_name = {s.name: s for s in spans}
        assert {by_name[n].service for n in ("job", "engine run", "lane wait")} == {"flatfare-worker"}
        # The worker's spans continue the gateway's through the traceparent its job carried.
        assert by_name["job"].parent_id == by_name["lane wait"].parent_id == gateway_span
        assert by_name["engine run"].parent_id == by_name["job"].span_id
        assert by_name["lane wait"].end_ns <= by_name["job"].start_ns + 10**9  # a clock of the same host
        assert all(s.end_ns >= s.start_ns > 0 for s in spans)
        assert len([s for s in spans if s.name == "job"]) == 1
    # A refusal (the body has no messages) is a trace too: its code on the request span and on the phase
    # it ended (admission); nothing reached the worker.
    refused = httpx.post(f"{mstack.base_url}{CHAT}", json={"model": MODEL}, headers=auth)
    assert refused.status_code == 400
    trace_id, gateway_span = refused.headers["traceparent"].split("-")[1:3]
    spans = _spans_of(receiver, trace_id, f"POST {CHAT}", "admission")
    root = tree(spans)
    assert root.span_id == gateway_span and root.parent_id == ""
    assert root.attributes["http.response.status_code"] == 400 and {s.service for s in spans} == {"flatfare-gateway"}
    code = root.attributes["flatfare.error_code"]
    assert code and {s.name: s.attributes.get("flatfare.error_code") for s in spans}["admission"] == code
    # A batch line: in the trace of the request that created the batch (a FastAPI route's span), under a
    # span of the dispatcher's, with the worker's spans beneath that.
    sdk = openai.OpenAI(base_url=f"{mstack.base_url}/v1", api_key=key, max_retries=0)
    uploaded = sdk.files.create(file=("requests.jsonl", chat_lines(MODEL, 1)), purpose="batch")
    created = sdk.batches.with_raw_response.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    batch, (trace_id, creating_span) = created.parse(), created.headers["traceparent"].split("-")[1:3]
    assert wait_for(sdk, batch.id, "completed", timeout_s=60).request_counts.completed == 1
    spans = _spans_of(receiver, trace_id, "POST /v1/batches", "batch line", "job", "engine run", "lane wait")
    root = tree(spans)
    assert (root.name, root.span_id) == ("POST /v1/batches", creating_span)
    by_name = {s.name: s for s in spans}
    assert by_name["batch line"].parent_id == creating_span
    assert by_name["job"].parent_id == by_name["batch line"].span_id
    assert by_name["job"].attributes["flatfare.request_id"] == contract.batch_request_id(batch.id, 0)
    assert not [s for trace_id in probes.values() for s in receiver.trace(trace_id)]  # exported long since


def test_vllms_own_span_hangs_under_the_workers_in_the_requests_trace(stack: Stack, stack_traces: OTLPReceiver) -> None:
    """The shared real-engine stack exports vLLM's spans (its otlp_traces_endpoint): a request its client
    traces is one trace from the gateway through the worker's job to vLLM's ``llm_request``."""
    trace_id = uuid.uuid4().hex
    answer = httpx.post(f"{stack.base_url}{CHAT}", timeout=120, json={
        "model": stack.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {stack.api_key}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert answer.status_code == 200, answer.text
    spans = _spans_of(stack_traces, trace_id, f"POST {CHAT}", "job", "engine run", "llm_request")
    tree(spans)
    by_name = {s.name: s for s in spans}
    assert by_name["llm_request"].parent_id == by_name["job"].span_id
    assert by_name["llm_request"].attributes["gen_ai.usage.completion_tokens"] == 4


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
