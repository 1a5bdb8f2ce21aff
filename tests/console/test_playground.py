"""The playground's messages are API requests of the account: streamed from the real engine, written
to the ledger under the account's playground key, and refused by the daily quota like any other."""

from __future__ import annotations

import pytest

from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient

pytestmark = pytest.mark.e2e


def _chat(customer: ConsoleClient, model: str):  # noqa: ANN202 - an httpx Response
    return customer.http.post("/console/playground/chat", headers={"X-CSRF-Token": customer.csrf},
                              json={"model": model, "max_tokens": 16, "temperature": 0,
                                    "messages": [{"role": "user", "content": "What is the capital of France?"}]})


def test_a_playground_message_is_a_counted_request_and_the_quota_refuses_the_next(stack: Stack,
                                                                                 customer: ConsoleClient) -> None:
    account_id = stack.sql("SELECT account_id FROM console_users WHERE email = :e", e=customer.email)[0][0]  # type: ignore[attr-defined]
    stack.sql("UPDATE accounts SET daily_limit_override = 1 WHERE id = :a", a=account_id)
    customer.get("/console/playground")
    first = _chat(customer, stack.model)
    assert first.status_code == 200, first.text
    assert first.headers["content-type"].startswith("text/event-stream")
    assert "Paris" in first.text and first.text.rstrip().endswith("data: [DONE]")
    rows = eventually(lambda: stack.sql("SELECT r.status, r.billable, k.name FROM requests r JOIN api_keys k "
                                        "ON k.id = r.api_key_id WHERE r.account_id = :a", a=account_id),
                      lambda found: found == [("succeeded", True, "Console playground")], "the ledger row")
    assert rows
    second = _chat(customer, stack.model)
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    # A model the plan does not allow is refused as through the API.
    unknown = _chat(customer, "no-such-model")
    assert unknown.status_code in (400, 403, 404) and unknown.json()["error"]["code"]
