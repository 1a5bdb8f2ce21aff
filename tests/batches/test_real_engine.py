"""A small batch on the real CPU engine (SmolLM2-135M, the shared stack): real answers come back in the
output file, matched by custom_id, with the engine's token counts on each line's ledger row."""

from __future__ import annotations

import json

from tests.batches.helpers import client, jsonl, start_batch, wait_for
from tests.conftest import Stack

QUESTIONS = {"france": "What is the capital of France?", "count": "Count from one to three.",
             "greet": "Say hello."}


def test_a_batch_on_the_real_engine_answers_each_line(stack: Stack) -> None:
    sdk = client(stack)
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": stack.model, "max_tokens": 24, "temperature": 0,
                                        "messages": [{"role": "user", "content": question}]}}) + "\n"
                   for cid, question in QUESTIONS.items()).encode()
    done = wait_for(sdk, start_batch(sdk, data).id, "completed", "failed")
    assert done.status == "completed" and done.request_counts.completed == 3, done
    answers = {line["custom_id"]: line["response"]["body"] for line in jsonl(sdk, done.output_file_id)}
    assert set(answers) == set(QUESTIONS)
    assert "Paris" in answers["france"]["choices"][0]["message"]["content"]
    assert all(body["model"] == stack.model and body["usage"]["completion_tokens"] > 0 for body in answers.values())
    rows = stack.sql("SELECT prompt_tokens, completion_tokens, billable FROM requests WHERE id LIKE :p",
                     p=f"{done.id}-%")
    assert len(rows) == 3 and all(p > 0 and c > 0 and billable for p, c, billable in rows)
