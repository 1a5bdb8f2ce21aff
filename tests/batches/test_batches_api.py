"""OpenAI's Batch API through the official SDK against a live stack (gateway, Redis, SQLite, an
instant-engine worker whose answers take 0.1 s each): a batch of 100 lines run and its output matched
by custom_id, each line billed once at the batch discount and on the batch allowance, cancel, list,
another account's batch, and a gateway killed mid-batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis as redis_sync
from openai import BadRequestError, ConflictError, NotFoundError

from flatfare import contract
from flatfare.gateway.batches.dispatcher import FEED_WINDOW
from tests.batches.helpers import batch_jobs_taken, chat_lines, client, jsonl, ledger, start_batch, wait_for
from tests.conftest import Stack, eventually, launch_stack, stop_process

MODEL = "instant"
PRICE = 2000
DISCOUNT = 25


@pytest.fixture(scope="module")
def bstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(tmp_path_factory.mktemp("batches"), model=MODEL, worker_args=("--engine", "instant"),
                      env={"FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "0.1"},
                      before_start=(f"UPDATE plans SET price_per_request_micros = {PRICE}, "
                                    f"batch_discount_percent = {DISCOUNT} WHERE name = 'pro'",)) as stack:
        yield stack


def test_a_batch_of_100_lines_runs_each_line_once_billed_at_the_discount(bstack: Stack) -> None:
    sdk = client(bstack)
    batch = start_batch(sdk, chat_lines(MODEL, 100), metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(sdk, batch.id, "completed")
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (100, 100, 0)
    assert done.error_file_id is None and done.completed_at and done.in_progress_at and done.finalizing_at
    output = jsonl(sdk, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(100))
    for line in output:
        index = int(line["custom_id"].removeprefix("req-"))
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == contract.batch_request_id(batch.id, index)
        assert line["response"]["body"]["choices"][0]["message"]["content"]
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"
    rows = ledger(bstack, batch.id)
    assert len(rows) == 100 and {r[1:] for r in rows} == {("batch:chat", True, PRICE * (100 - DISCOUNT) // 100,
                                                          "succeeded")}
    # One usage row a line, for Stripe's batch meter (this stack has no Stripe: they wait, pending).
    usage = bstack.sql("SELECT meter, status, count(*) FROM usage_outbox WHERE request_id LIKE :p GROUP BY meter, status",
                       p=f"{batch.id}-%")
    assert [tuple(row) for row in usage] == [("batch_requests", "pending", 100)]
    assert batch_jobs_taken(bstack) >= 100


def test_batch_lines_count_on_the_batch_allowance_not_the_live_quota(bstack: Stack) -> None:
    created = bstack.cli("keys", "create", "--account", "allowance", "--plan", "trial")
    assert created.returncode == 0, created.stderr
    bstack.sql("UPDATE plans SET batch_daily_limit = 150 WHERE name = 'trial'")
    sdk = client(bstack, created.stdout.strip())
    first = wait_for(sdk, start_batch(sdk, chat_lines(MODEL, 100)).id, "completed", "failed")
    assert first.status == "completed", first.errors
    second = wait_for(sdk, start_batch(sdk, chat_lines(MODEL, 100)).id, "completed", "failed")
    assert second.status == "failed" and second.errors.data[0].code == "batch_allowance_exceeded"
    assert "50 of 150 left" in second.errors.data[0].message
    assert ledger(bstack, second.id) == [] and second.output_file_id is None
    (account_id,), = bstack.sql("SELECT id FROM accounts WHERE name = 'allowance'")
    live = redis_sync.Redis.from_url(bstack.redis_url)
    try:  # no live quota unit for a batch line
        day = datetime.now(UTC).date().isoformat()
        assert int(live.get(contract.quota_counter_key(account_id, day)) or 0) == 0
    finally:
        live.close()
    third = wait_for(sdk, start_batch(sdk, chat_lines(MODEL, 50)).id, "completed", "failed")
    assert third.status == "completed", third.errors  # exactly what was left


def test_a_cancelled_batch_stops_and_keeps_what_finished(bstack: Stack) -> None:
    sdk = client(bstack)
    batch = start_batch(sdk, chat_lines(MODEL, 100))
    eventually(lambda: sdk.batches.retrieve(batch.id), lambda b: b.request_counts.completed >= 5,
               "five lines done", timeout_s=120)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(sdk, batch.id, "cancelled")
    assert done.cancelled_at and done.request_counts.completed < 100
    answered, errors = jsonl(sdk, done.output_file_id), jsonl(sdk, done.error_file_id)
    assert len(answered) == done.request_counts.completed
    assert len(answered) + len(errors) == 100
    assert {e["error"]["code"] for e in errors if e["error"]} == {"batch_cancelled"}
    billed = [r for r in ledger(bstack, batch.id) if r[2]]
    assert len(billed) == done.request_counts.completed
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes
    completed = wait_for(sdk, start_batch(sdk, chat_lines(MODEL, 1)).id, "completed")
    with pytest.raises(ConflictError) as refused:
        sdk.batches.cancel(completed.id)
    assert refused.value.code == "batch_not_cancellable"


def test_batches_are_listed_newest_first_and_are_the_account_s_own(bstack: Stack) -> None:
    sdk = client(bstack)
    data = chat_lines(MODEL, 2)
    ids = [start_batch(sdk, data).id for _ in range(3)]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    after = sdk.batches.list(limit=1, after=ids[1])
    assert [b.id for b in after.data] == [ids[0]]
    created = bstack.cli("keys", "create", "--account", "stranger", "--plan", "pro")
    stranger = client(bstack, created.stdout.strip())
    with pytest.raises(NotFoundError):
        stranger.batches.retrieve(ids[0])
    with pytest.raises(NotFoundError):
        stranger.batches.cancel(ids[0])
    assert ids[0] not in [b.id for b in stranger.batches.list().data]
    with pytest.raises(BadRequestError) as foreign:  # nor may it run the other account's input file
        stranger.batches.create(input_file_id=sdk.batches.retrieve(ids[0]).input_file_id,
                                endpoint="/v1/chat/completions", completion_window="24h")
    assert foreign.value.code == "invalid_input_file"
    for batch_id in ids:
        wait_for(sdk, batch_id, "completed")


def test_bad_requests_get_openai_errors_and_leave_nothing(bstack: Stack) -> None:
    sdk = client(bstack)
    uploaded = sdk.files.create(file=("r.jsonl", chat_lines(MODEL, 1)), purpose="batch")
    before = bstack.sql("SELECT count(*) FROM batches")
    for kwargs, param in (({"endpoint": "/v1/images", "completion_window": "24h"}, "endpoint"),
                          ({"endpoint": "/v1/chat/completions", "completion_window": "1h"}, "completion_window"),
                          ({"endpoint": "/v1/chat/completions", "completion_window": "24h",
                            "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata")):
        with pytest.raises(BadRequestError) as bad:
            sdk.batches.create(input_file_id=uploaded.id, **kwargs)  # type: ignore[arg-type]
        assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body
    assert bstack.sql("SELECT count(*) FROM batches") == before
    mismatched = sdk.files.create(file=("c.jsonl", chat_lines(MODEL, 2)), purpose="batch")
    batch = sdk.batches.create(input_file_id=mismatched.id, endpoint="/v1/completions", completion_window="24h")
    failed = wait_for(sdk, batch.id, "failed")
    assert [(e.code, e.line) for e in failed.errors.data] == [("mismatched_url", 1), ("mismatched_url", 2)]
    assert ledger(bstack, batch.id) == []


def _gateway(stack: Stack, log: Path) -> subprocess.Popen[bytes]:
    port = stack.base_url.rsplit(":", 1)[1]
    return subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", port], env=stack.env,
                            cwd=stack.logs.parent, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def test_a_gateway_killed_mid_batch_resumes_and_runs_each_line_once(tmp_path: Path) -> None:
    """Each answer takes 15 s, longer than the dead dispatcher's lease (10 s) and the restart, so the
    new dispatcher finds lines queued whose jobs still run, and lines whose replies came while no
    dispatcher ran; SQL alone says which is which."""
    lines = 2 * FEED_WINDOW
    with launch_stack(tmp_path, model=MODEL, worker_args=("--engine", "instant"),
                      env={"FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": "15"}) as stack:
        sdk = client(stack)
        batch = start_batch(sdk, chat_lines(MODEL, lines))
        eventually(lambda: sdk.batches.retrieve(batch.id), lambda b: b.request_counts.completed >= FEED_WINDOW,
                   "the first window done", timeout_s=120)
        eventually(lambda: _queued(stack, batch.id), lambda n: n == FEED_WINDOW, "the second window queued", timeout_s=60)
        os.kill(stack.gateway.pid, signal.SIGKILL)  # the dispatcher dies with lines queued and running
        stack.gateway.wait()
        restarted = _gateway(stack, stack.logs / "gateway-restarted.log")
        try:
            done = wait_for(sdk, batch.id, "completed")
            assert done.request_counts.completed == lines
            output = jsonl(sdk, done.output_file_id)
            assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(lines))
            rows = ledger(stack, batch.id)
            assert len(rows) == lines and all(r[2] for r in rows)
            live = redis_sync.Redis.from_url(stack.redis_url)
            try:  # every job fed was run and acknowledged: none was fed twice
                assert live.xlen(contract.job_stream(MODEL, contract.Lane.BATCH)) == 0
            finally:
                live.close()
            assert batch_jobs_taken(stack) == lines
        finally:
            stop_process(restarted)


def _queued(stack: Stack, batch_id: str) -> int:
    return stack.sql("SELECT count(*) FROM batch_lines WHERE batch_id = :b AND status = 'queued'", b=batch_id)[0][0]


def test_the_output_lines_are_openai_s_format(bstack: Stack) -> None:
    sdk = client(bstack)
    done = wait_for(sdk, start_batch(sdk, chat_lines(MODEL, 1)).id, "completed")
    (line,) = jsonl(sdk, done.output_file_id)
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert set(line["response"]) == {"status_code", "request_id", "body"}
    assert json.loads(json.dumps(line["response"]["body"]))["object"] == "chat.completion"


def test_a_line_a_live_request_would_be_refused_for_fails_free_and_the_rest_run(bstack: Stack) -> None:
    sdk = client(bstack)
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    bodies = {"good": good, "greedy": {**good, "n": 50}, "nowhere": {**good, "model": "no-such-model"}}
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
                   for cid, body in bodies.items()).encode()
    done = wait_for(sdk, start_batch(sdk, data).id, "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    errors = {line["custom_id"]: line["response"] for line in jsonl(sdk, done.error_file_id)}
    assert errors["greedy"]["status_code"] == 400 and errors["greedy"]["body"]["error"]["code"] == "too_many_sequences"
    assert errors["nowhere"]["status_code"] == 404 and errors["nowhere"]["body"]["error"]["code"] == "model_not_found"
    assert [r[0] for r in ledger(bstack, done.id)] == [f"{done.id}-0"]  # refused lines never ran: no row


def test_a_responses_batch_runs_unstored_and_refuses_previous_response_id(bstack: Stack) -> None:
    """/v1/responses lines run like the others (billed at the discount), their answers only in the output
    file: a line naming previous_response_id fails free (a batch has no conversation to continue)."""
    sdk = client(bstack)
    lines = {"fresh": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
             "continued": {"model": MODEL, "input": "and then?", "previous_response_id": "resp_abc"}}
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": body}) + "\n"
                   for cid, body in lines.items()).encode()
    uploaded = sdk.files.create(file=("responses.jsonl", data), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_for(sdk, batch.id, "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    (error,) = jsonl(sdk, done.error_file_id)
    assert error["custom_id"] == "continued" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "unsupported_parameter"
    (row,) = ledger(bstack, done.id)
    assert row[1:] == ("batch:responses", True, PRICE * (100 - DISCOUNT) // 100, "succeeded")
    # The line's job asked the worker's vLLM to keep nothing, and Flatfare kept nothing either.
    assert not bstack.sql("SELECT count(*) FROM stored_responses")[0][0]
