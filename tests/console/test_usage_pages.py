"""The usage page in a real browser on the shared live stack (the real engine): a call made with the
openai SDK and a console key shows in today's count, the 30-day chart's data, the by-model and by-key
charts, the table and the CSV export; one customer never sees another's usage, whatever ids they send."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import openai
import pytest

from tests.conftest import Stack, eventually
from tests.console.conftest import ConsoleClient, new_email, screenshot
from flatfare.gateway.console.usage_pages import spreadsheet_safe

pytestmark = pytest.mark.e2e


def _customer(stack: Stack, tag: str) -> ConsoleClient:
    client = ConsoleClient(stack)
    client.email = new_email(tag)  # type: ignore[attr-defined]
    client.signup(client.email)  # type: ignore[attr-defined]
    return client


def _chart(page) -> dict:  # noqa: ANN001 - a Playwright Page
    return json.loads(page.locator("#usage-daily").get_attribute("data-chart"))


def test_a_call_made_with_the_sdk_shows_on_the_usage_page(stack: Stack, page, tmp_path: Path) -> None:  # noqa: ANN001
    client = _customer(stack, "usage")
    key_id, secret = client.create_key("usage-laptop")
    sdk = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=secret, max_retries=0, timeout=300)
    reply = sdk.chat.completions.create(model=stack.model, max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": "Say hi."}])
    assert reply.choices[0].message.content is not None

    page.context.add_cookies([{"name": "ff_console", "value": client.session_cookie, "url": stack.base_url}])
    page.goto(f"{stack.base_url}/console/usage")
    assert page.locator("#today-count").inner_text() == "1"
    chart = _chart(page)
    assert len(chart["requests"]) == 30 and chart["requests"][-1] == 1 and chart["billable"][-1] == 1
    assert sum(chart["requests"]) == 1
    assert chart["models"] == {"labels": [stack.model], "requests": [1]}
    assert chart["keys"] == {"labels": ["usage-laptop"], "requests": [1]}
    # Chart.js drew it (the canvas got its chart, from the vendored static file, under the CSP).
    page.locator("#usage-daily[data-drawn='1']").wait_for()
    rows = page.locator("#usage-table tbody tr")
    assert rows.count() == 1 and "usage-laptop" in rows.first.inner_text() and stack.model in rows.first.inner_text()
    screenshot(page, "console-usage", tmp_path)

    exported = client.get("/console/usage.csv")
    assert exported.status_code == 200 and exported.headers["content-type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(exported.text)))
    assert [(row["key_id"], row["key_name"], row["model"], row["requests"], row["billable_requests"])
            for row in lines] == [(str(key_id), "usage-laptop", stack.model, "1", "1")]
    client.close()


def test_no_customer_sees_another_customers_usage(stack: Stack) -> None:
    alice, bob = _customer(stack, "alice"), _customer(stack, "bob")
    key_id, secret = alice.create_key("=HYPERLINK(\"http://x\")")  # also: a name that is a spreadsheet formula
    sdk = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=secret, max_retries=0, timeout=300)
    sdk.chat.completions.create(model=stack.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    alice_id = stack.sql("SELECT account_id FROM api_keys WHERE id = :k", k=key_id)[0][0]
    eventually(lambda: alice.get("/console/usage.csv").text, lambda text: "HYPERLINK" in text, "Alice's row")
    assert "'=HYPERLINK" in alice.get("/console/usage.csv").text  # quoted: a spreadsheet shows it as text
    # Bob's pages and export show nothing of Alice's, whatever ids he sends.
    for path in ("/console/usage", f"/console/usage?account_id={alice_id}", f"/console/usage?key_id={key_id}",
                 "/console/usage.csv", f"/console/usage.csv?account_id={alice_id}&key_id={key_id}"):
        response = bob.get(path)
        assert response.status_code == 200, path
        assert "HYPERLINK" not in response.text, path
    assert len(list(csv.reader(io.StringIO(bob.get("/console/usage.csv").text)))) == 1  # the header alone
    # Logged out: the login, not the data.
    anonymous = ConsoleClient(stack)
    assert anonymous.http.get("/console/usage.csv").status_code == 303
    assert anonymous.http.get("/console/usage").status_code == 303
    for client in (alice, bob, anonymous):
        client.close()


def _mismatches(stack: Stack) -> list[tuple]:
    """Rollup rows that differ from a GROUP BY over the ledger, either way, read in one statement (one
    snapshot: every ledger transaction writes its rows and its rollup together)."""
    day = ("COALESCE(quota_day, substr(created_at, 1, 10))" if stack.database_url.startswith("sqlite")
           else "COALESCE(quota_day, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD'))")
    ledger = (f"SELECT account_id, {day} AS day, api_key_id, model, count(*) AS r, "
              "sum(CASE WHEN billable THEN 1 ELSE 0 END) AS b, "
              "sum(CASE WHEN billable THEN price_micros ELSE 0 END) AS p "
              f"FROM requests GROUP BY account_id, {day}, api_key_id, model")
    rolled = ("SELECT account_id, day, api_key_id, model, requests, billable_requests, price_micros FROM usage_daily "
              "WHERE requests <> 0 OR billable_requests <> 0 OR price_micros <> 0")
    return stack.sql(f"WITH l AS ({ledger}), u AS ({rolled}) "
                     "SELECT * FROM (SELECT * FROM l EXCEPT SELECT * FROM u) AS missing "
                     "UNION ALL SELECT * FROM (SELECT * FROM u EXCEPT SELECT * FROM l) AS extra")


def test_the_rollup_equals_the_ledger_on_the_live_stack(stack: Stack) -> None:
    """Whatever the session's tests sent through the shared stack so far (the real engine: succeeded,
    failed, cancelled, refused requests), the rollup the pages read says exactly what the ledger says."""
    sdk = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    sdk.chat.completions.create(model=stack.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):  # refused before anything is written or counted
        sdk.chat.completions.create(model=stack.model, max_tokens=4, messages=[], n=0)
    assert stack.sql("SELECT count(*) FROM requests")[0][0] > 0
    assert _mismatches(stack) == []


def test_every_text_cell_of_the_csv_is_guarded_after_leading_whitespace() -> None:
    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\t=1", "\r=1", "  =HYPERLINK(\"x\")", " \u00a0@x"):
        assert spreadsheet_safe(text).startswith("'"), repr(text)
    for text in ("SmolLM2-135M", "my key", "ff-abcdefgh", ""):
        assert spreadsheet_safe(text) == text
