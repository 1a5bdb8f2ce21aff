"""What the batch tests share: input files, the SDK client, waiting for a batch, reading the ledger."""

from __future__ import annotations

import json
from typing import Any

import httpx
import redis as redis_sync
from openai import APIConnectionError, OpenAI
from openai.types import Batch
from prometheus_client.parser import text_string_to_metric_families

from flatfare import contract
from flatfare.contract import WorkerInfo
from tests.conftest import Stack, eventually

BATCH_DONE_S = 180.0


def client(stack: Stack, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=key or stack.api_key, max_retries=0, timeout=60)


def chat_lines(model: str, count: int, prompt: str = "Say hello to number {i}.", max_tokens: int = 8) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": prompt.format(i=i)}]}}) + "\n"
                   for i in range(count)).encode()


def start_batch(sdk: OpenAI, data: bytes, **kwargs: Any) -> Batch:
    uploaded = sdk.files.create(file=("requests.jsonl", data), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                              **kwargs)


def wait_for(sdk: OpenAI, batch_id: str, *statuses: str, timeout_s: float = BATCH_DONE_S) -> Batch:
    """The batch once in one of ``statuses`` (a gateway that is restarting is asked again)."""
    def read() -> Batch | None:
        try:
            return sdk.batches.retrieve(batch_id)
        except APIConnectionError:
            return None

    found = eventually(read, lambda b: b is not None and b.status in statuses,
                       f"batch {batch_id} {'/'.join(statuses)}", timeout_s=timeout_s, every_s=0.2)
    assert found is not None
    return found


def jsonl(sdk: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines() if line]


def ledger(stack: Stack, batch_id: str) -> list[tuple]:
    """(id, endpoint, billable, price_micros, status) of the batch's ledger rows."""
    return stack.sql("SELECT id, endpoint, billable, price_micros, status FROM requests WHERE id LIKE :p ORDER BY id",
                     p=f"{batch_id}-%")


def batch_jobs_taken(stack: Stack) -> int:
    """Jobs the stack's workers took from the batch lane (their queue-wait histograms' counts)."""
    client_ = redis_sync.Redis.from_url(stack.redis_url)
    try:
        infos = [WorkerInfo.from_fields(f) for f in (client_.hgetall(contract.worker_key(w.decode()))
                                                     for w in client_.zrange(contract.pool_key(stack.model), 0, -1)) if f]
    finally:
        client_.close()
    taken = 0
    for info in infos:
        text = httpx.get(f"http://127.0.0.1:{info.extra['metrics_port']}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "flatfare_worker_queue_wait_seconds_count" and sample.labels["lane"] == "batch":
                    taken += int(sample.value)
    return taken
