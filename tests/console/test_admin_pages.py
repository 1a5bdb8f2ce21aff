"""The admin console against a running gateway (instant engine), on SQLite and PostgreSQL: over plain
HTTP, every page renders, only an admin session reaches it, every write needs the session's CSRF
token and the admin:write scope, goes through the admin API's services and lands in the audit log;
in a real browser (Chromium, tests/console/conftest.py's ``page``), an admin changes a plan's daily
limit and the customer's /v1/usage and console page show it. That test also takes the admin
screenshots (docs/screenshots/admin-*.png, with FLATFARE_TEST_SCREENSHOTS=1). Teams' whole flow in the
browser is here too (this stack has the admin API to check it with)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import openai
import pytest

from flatfare.gateway.console.mail import LOG_MARK
from tests.conftest import eventually, launch_stack, postgres_database
from tests.console.conftest import PASSWORD, clear_attempts
from tests.console.conftest import screenshot as console_screenshot

pytestmark = pytest.mark.e2e

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
CUSTOMER_EMAIL = "dev@example.com"
CUSTOMER_PASSWORD = "correct horse battery"


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def astack(request, tmp_path_factory):
    database = postgres_database() if request.param == "postgresql" else iter([None])
    try:
        yield from _admin_stack(tmp_path_factory.mktemp(f"console-admin-{request.param}"), next(database))
    finally:
        for _ in database:  # drops the PostgreSQL database
            pass


def _admin_stack(data, database_url):
    with launch_stack(data, model="instant", worker_args=("--engine", "instant"), database_url=database_url,
                      env={"FLATFARE_PLANS_CACHE_TTL_S": "0.3"}) as stack:
        token = stack.cli("admin", "bootstrap", "--name", "ops")
        assert token.returncode == 0, token.stderr
        stack.admin_token = token.stdout.strip()
        api = httpx.Client(base_url=f"{stack.base_url}/admin/v1", timeout=30,
                           headers={"Authorization": f"Bearer {stack.admin_token}"})
        read_only = api.post("/tokens", json={"name": "viewer", "scopes": ["admin:read"]})
        assert read_only.status_code == 201, read_only.text
        stack.read_token = read_only.json()["token"]
        # The instant worker's model, catalogued so the console can manage it.
        assert api.post("/models", json={"name": "instant", "source": "instant"}).status_code == 201
        stack.api = api

        with console(stack.base_url) as visitor:  # a customer signs up, as anyone can
            form = visitor.get("/console/signup")
            made = visitor.post("/console/signup", data={"csrf_token": csrf_of(form.text), "email": CUSTOMER_EMAIL,
                                                         "password": CUSTOMER_PASSWORD})
            assert made.status_code == 303, made.text
        stack.customer_account = stack.sql("SELECT account_id FROM console_users WHERE email = :e",
                                           e=CUSTOMER_EMAIL)[0][0]
        yield stack
        api.close()


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def console(base_url: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=30, follow_redirects=False)


def admin_login(base_url: str, token: str) -> tuple[httpx.Client, str]:
    """A client logged in with an admin token, and its session's CSRF token."""
    client = console(base_url)
    page = client.get("/console/login", params={"admin": 1})
    answer = client.post("/console/login", data={"csrf_token": csrf_of(page.text), "mode": "admin",
                                                 "admin_token": token})
    assert answer.status_code == 303 and answer.headers["location"] == "/console/admin", answer.text
    dashboard = client.get("/console/admin")
    assert dashboard.status_code == 200, dashboard.text
    return client, csrf_of(dashboard.text)


def customer_login(base_url: str) -> tuple[httpx.Client, str]:
    client = console(base_url)
    page = client.get("/console/login")
    answer = client.post("/console/login", data={"csrf_token": csrf_of(page.text), "email": CUSTOMER_EMAIL,
                                                 "password": CUSTOMER_PASSWORD})
    assert answer.status_code == 303 and answer.headers["location"] == "/console", answer.text
    return client, csrf_of(client.get("/console").text)


@pytest.fixture(scope="module")
def admin(astack) -> tuple[httpx.Client, str]:
    client, csrf = admin_login(astack.base_url, astack.admin_token)
    yield client, csrf
    client.close()


def audit_entries(astack, action: str) -> list[dict]:
    return astack.api.get("/audit", params={"action": action, "limit": 200}).json()["data"]


def e2e_account(astack) -> int:
    return astack.sql("SELECT id FROM accounts WHERE name = 'e2e'")[0][0]


def admin_pages(astack) -> list[str]:
    account_id = e2e_account(astack)
    return ["/console/admin", "/console/admin/accounts", "/console/admin/accounts?q=e2e",
            f"/console/admin/accounts/{account_id}", "/console/admin/plans", "/console/admin/plans/pro",
            "/console/admin/plans/pro/card", "/console/admin/models", "/console/admin/usage",
            "/console/admin/usage?days=7", "/console/admin/audit"]


def test_every_admin_page_renders_for_an_admin(astack, admin) -> None:
    client, _ = admin
    for path in admin_pages(astack):
        page = client.get(path)
        assert page.status_code == 200, (path, page.text[:500])
        assert "text/html" in page.headers["content-type"]
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert "e2e" in client.get("/console/admin/accounts", params={"q": "e2e"}).text
    assert "No account matches" in client.get("/console/admin/accounts", params={"q": "nobody-here"}).text
    # A console user's email finds its account too.
    assert f"/console/admin/accounts/{astack.customer_account}\"" in client.get(
        "/console/admin/accounts", params={"q": "dev@exa"}).text


def test_nobody_but_an_admin_session_reaches_an_admin_page(astack) -> None:
    """Anonymous visitors, API keys, admin tokens sent as headers and customers are sent to the admin
    login (or, for htmx, answered 401 with where to go), and see no admin data."""
    customer, customer_csrf = customer_login(astack.base_url)
    callers = {
        "anonymous": (console(astack.base_url), {}),
        "api key": (console(astack.base_url), {"Authorization": f"Bearer {astack.api_key}"}),
        "admin token header": (console(astack.base_url), {"Authorization": f"Bearer {astack.admin_token}"}),
        "customer": (customer, {}),
    }
    for who, (client, headers) in callers.items():
        for path in admin_pages(astack):
            page = client.get(path, headers=headers)
            assert page.status_code == 303, (who, path, page.status_code)
            assert page.headers["location"] == "/console/login?admin=1", (who, path)
        partial = client.get("/console/admin/models", headers={**headers, "HX-Request": "true",
                                                                "HX-Target": "model-rows"})
        assert partial.status_code == 401 and partial.headers["hx-redirect"] == "/console/login?admin=1", who
        assert partial.json()["error"]["code"] == "login_required"
        write = client.post("/console/admin/plans/free", headers=headers, data={"daily_limit": "1"})
        assert write.status_code == 401 and write.json()["error"]["code"] == "login_required", who
    # A customer's own valid CSRF token does not make a write an admin's.
    account_id = e2e_account(astack)
    before = len(audit_entries(astack, "account.update"))
    refused = customer.post(f"/console/admin/accounts/{account_id}/status",
                            data={"csrf_token": customer_csrf, "status": "suspended"})
    assert refused.status_code in (303, 401) and "admin=1" in refused.headers.get(
        "location", refused.headers.get("hx-redirect", ""))
    assert astack.sql("SELECT status FROM accounts WHERE id = :i", i=account_id) == [("active",)]
    assert len(audit_entries(astack, "account.update")) == before


def test_admin_writes_need_the_sessions_csrf_token(astack, admin) -> None:
    client, csrf = admin
    account_id = e2e_account(astack)
    before = len(audit_entries(astack, "account.update")) + len(audit_entries(astack, "plan.update"))
    writes = [(f"/console/admin/accounts/{account_id}/status", {"status": "suspended"}),
              (f"/console/admin/accounts/{account_id}/plan", {"plan": "premium"}),
              ("/console/admin/plans/pro", {"daily_limit": "7"}),
              ("/console/admin/models/instant", {"pinned": "true"})]
    for path, form in writes:
        for token in (None, "forged-" + csrf[7:], ""):
            data = form if token is None else {**form, "csrf_token": token}
            refused = client.post(path, data=data)
            assert refused.status_code == 403, (path, token, refused.text)
            assert refused.json()["error"]["code"] == "csrf_failed"
    assert astack.sql("SELECT status, plan FROM accounts WHERE id = :i", i=account_id) == [("active", "pro")]
    assert astack.sql("SELECT daily_limit FROM plans WHERE name = 'pro'") != [(7,)]
    assert len(audit_entries(astack, "account.update")) + len(audit_entries(astack, "plan.update")) == before


def test_a_read_only_token_sees_but_cannot_write(astack) -> None:
    client, csrf = admin_login(astack.base_url, astack.read_token)
    account_id = e2e_account(astack)
    assert client.get(f"/console/admin/accounts/{account_id}").status_code == 200
    refused = client.post(f"/console/admin/accounts/{account_id}/status",
                          data={"csrf_token": csrf, "status": "suspended"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    refused = client.post("/console/admin/plans/pro", data={"csrf_token": csrf, "daily_limit": "5"})
    assert refused.status_code == 403
    assert astack.sql("SELECT status FROM accounts WHERE id = :i", i=account_id) == [("active",)]


def test_an_admin_user_logs_in_with_a_password_and_is_audited_by_email(astack) -> None:
    from argon2 import PasswordHasher

    astack.sql("INSERT INTO console_users (email, password_hash, is_admin, email_verified_at, created_at) "
               "VALUES ('boss@example.com', :h, :t, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
               h=PasswordHasher().hash(CUSTOMER_PASSWORD), t=True)
    client = console(astack.base_url)
    form = client.get("/console/login")
    answer = client.post("/console/login", data={"csrf_token": csrf_of(form.text), "email": "boss@example.com",
                                                 "password": CUSTOMER_PASSWORD})
    assert answer.status_code == 303 and answer.headers["location"] == "/console/admin"
    csrf = csrf_of(client.get("/console/admin").text)
    done = client.post("/console/admin/plans/free", data={**dict(re.findall(
        r'<input type="text" name="([a-z_]+)" value="([^"]*)"', client.get("/console/admin/plans/free").text)),
        "lane": "standard", "csrf_token": csrf, "max_inflight": "5"})
    assert done.status_code == 303, done.text
    entry = audit_entries(astack, "plan.update")[0]
    assert (entry["actor"], entry["actor_id"], entry["after"]["max_inflight"]) == ("console:boss@example.com", None, 5)
    astack.api.patch("/plans/free", json={"max_inflight": entry["before"]["max_inflight"]})
    client.close()


def _chat(astack, key: str) -> httpx.Response:
    return httpx.post(f"{astack.base_url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "instant", "messages": [{"role": "user", "content": "hi"}]})


def test_suspend_and_reactivate_through_the_console_are_audited_and_take_effect(astack, admin) -> None:
    client, csrf = admin
    account_id = e2e_account(astack)
    done = client.post(f"/console/admin/accounts/{account_id}/status", data={"csrf_token": csrf,
                                                                           "status": "suspended"})
    assert done.status_code == 303 and done.headers["location"].endswith("?done=suspended")
    assert "The account was suspended." in client.get(done.headers["location"]).text
    eventually(lambda: _chat(astack, astack.api_key), lambda r: r.status_code == 403, "the suspended key refused")
    entry = audit_entries(astack, "account.update")[0]
    assert (entry["actor"], entry["resource_id"]) == ("ops", str(account_id))
    assert (entry["before"]["status"], entry["after"]["status"]) == ("active", "suspended")
    # The htmx form gets the account's summary back, not a redirect.
    again = client.post(f"/console/admin/accounts/{account_id}/status", data={"status": "active"},
                        headers={"HX-Request": "true", "X-CSRF-Token": csrf})
    assert again.status_code == 200 and 'id="account-summary"' in again.text and "<html" not in again.text
    assert "The account is active again." in again.text
    eventually(lambda: _chat(astack, astack.api_key), lambda r: r.status_code == 200, "the key works again")
    assert audit_entries(astack, "account.update")[0]["after"]["status"] == "active"


def test_change_plan_through_the_console(astack, admin) -> None:
    client, csrf = admin
    account_id = astack.customer_account
    done = client.post(f"/console/admin/accounts/{account_id}/plan", data={"csrf_token": csrf, "plan": "premium"})
    assert done.status_code == 303, done.text
    assert astack.sql("SELECT plan FROM accounts WHERE id = :i", i=account_id) == [("premium",)]
    entry = audit_entries(astack, "account.update")[0]
    assert (entry["before"]["plan"], entry["after"]["plan"]) == ("free", "premium")
    # An unknown plan is refused by the same service as the API's, shown on the page, and changes nothing.
    refused = client.post(f"/console/admin/accounts/{account_id}/plan", data={"csrf_token": csrf, "plan": "gold"})
    assert refused.status_code == 422 and "Unknown plan" in refused.text
    assert astack.sql("SELECT plan FROM accounts WHERE id = :i", i=account_id) == [("premium",)]
    assert client.get("/console/admin/accounts/999999").status_code == 404
    assert client.get("/console/admin/accounts/0").status_code == 400


def test_editing_a_plan_validates_like_the_api_and_audits(astack, admin) -> None:
    client, csrf = admin
    before = len(audit_entries(astack, "plan.update"))
    original = astack.api.get("/plans/pro").json()
    form = dict(re.findall(r'<input type="text" name="([a-z_]+)" value="([^"]*)"',
                           client.get("/console/admin/plans/pro").text))
    assert form["daily_limit"] == f"{original['daily_limit']}" and form["display_name"] == original["display_name"]
    form["lane"] = re.search(r'<option value="(\w+)" selected>', client.get("/console/admin/plans/pro").text).group(1)
    bad = {**form, "csrf_token": csrf, "daily_limit": "lots", "max_inflight": "0", "timezone": "Mars/Olympus",
           "price_per_request": "-1"}
    page = client.post("/console/admin/plans/pro", data=bad)
    assert page.status_code == 422
    assert "Enter a whole number." in page.text and "Enter an amount of zero or more." in page.text
    assert "nothing was saved" in page.text
    page = client.post("/console/admin/plans/pro", data={**form, "csrf_token": csrf, "max_inflight": "0",
                                                          "timezone": "Mars/Olympus"})
    assert page.status_code == 422
    assert "greater than or equal to 1" in page.text and "Unknown timezone" in page.text
    assert len(audit_entries(astack, "plan.update")) == before
    # Unchanged: nothing is written.
    same = client.post("/console/admin/plans/pro", data={**form, "csrf_token": csrf})
    assert same.status_code == 303 and same.headers["location"].endswith("done=unchanged")
    assert len(audit_entries(astack, "plan.update")) == before
    # A real edit, through htmx: the card comes back with the new values; the audit entry has only them changed.
    saved = client.post("/console/admin/plans/pro", headers={"HX-Request": "true", "X-CSRF-Token": csrf},
                        data={**form, "daily_limit": "1,234", "price_per_request": "0.0025"})
    assert saved.status_code == 200 and 'class="card plan-card' in saved.text and "1,234" in saved.text
    assert astack.sql("SELECT daily_limit, price_per_request_micros FROM plans WHERE name = 'pro'") == [(1234, 2500)]
    entry = audit_entries(astack, "plan.update")[0]
    assert entry["actor"] == "ops" and entry["resource_id"] == "pro"
    changed = {k for k in entry["after"] if entry["after"][k] != entry["before"][k]}
    assert changed == {"daily_limit", "price_per_request_micros"}
    # Put it back through the API (the same service).
    restored = astack.api.patch("/plans/pro", json={k: original[k]
                                                     for k in ("daily_limit", "price_per_request_micros")})
    assert restored.status_code == 200


def test_the_plan_form_edits_the_batch_and_embedding_columns(astack, admin) -> None:
    client, csrf = admin
    original = astack.api.get("/plans/pro").json()
    text = client.get("/console/admin/plans/pro").text
    form = dict(re.findall(r'<input type="text" name="([a-z_]+)" value="([^"]*)"', text))
    assert "Batch discount (%)" in text and "Batch lines a day" in text and "Embedding inputs" in text
    assert (form["batch_discount_percent"], form["batch_daily_limit"], form["max_embedding_inputs"]) == (
        str(original["batch_discount_percent"]), str(original["batch_daily_limit"]),
        str(original["max_embedding_inputs"]))
    form["lane"] = re.search(r'<option value="(\w+)" selected>', text).group(1)
    before = len(audit_entries(astack, "plan.update"))
    refused = client.post("/console/admin/plans/pro", data={**form, "csrf_token": csrf, "max_embedding_inputs": ""})
    assert refused.status_code == 422 and "Required." in refused.text
    refused = client.post("/console/admin/plans/pro", data={**form, "csrf_token": csrf, "batch_discount_percent": "101",
                                                             "batch_daily_limit": "0"})
    assert refused.status_code == 422 and "less than or equal to 100" in refused.text
    assert "greater than or equal to 1" in refused.text
    assert len(audit_entries(astack, "plan.update")) == before
    saved = client.post("/console/admin/plans/pro", headers={"HX-Request": "true", "X-CSRF-Token": csrf},
                        data={**form, "batch_discount_percent": "25", "batch_daily_limit": "", "max_embedding_inputs": "8"})
    assert saved.status_code == 200 and "25 %" in saved.text
    assert astack.sql("SELECT batch_discount_percent, batch_daily_limit, max_embedding_inputs FROM plans "
                      "WHERE name = 'pro'") == [(25, None, 8)]
    entry = audit_entries(astack, "plan.update")[0]
    assert {k for k in entry["after"] if entry["after"][k] != entry["before"][k]} == {
        "batch_discount_percent", "batch_daily_limit", "max_embedding_inputs"}
    assert astack.api.patch("/plans/pro", json={k: original[k] for k in (
        "batch_discount_percent", "batch_daily_limit", "max_embedding_inputs")}).status_code == 200


def test_models_page_shows_live_state_and_its_writes_are_audited(astack, admin) -> None:
    client, csrf = admin
    assert _chat(astack, astack.api_key).status_code == 200

    def row() -> str:
        page = client.get("/console/admin/models", headers={"HX-Request": "true", "HX-Target": "model-rows"})
        assert page.status_code == 200 and page.text.startswith('<tbody id="model-rows"')
        return page.text.split("<strong>instant</strong>", 1)[1].split("</tr>", 1)[0]

    live = eventually(row, lambda r: ">warm<" in r, "the instant worker shown warm")
    cells = re.findall(r'<td class="num">(.*?)</td>', live, re.S)
    assert cells[0].strip().startswith("1")  # one worker
    requests_today = int(cells[3].replace(",", ""))
    assert requests_today >= 1
    done = client.post("/console/admin/models/instant", headers={"HX-Request": "true", "X-CSRF-Token": csrf},
                       data={"min_workers": "2"})
    assert done.status_code == 200 and '<span class="step-value">2</span>' in done.text
    entry = audit_entries(astack, "model.update")[0]
    assert (entry["resource_id"], entry["before"]["min_workers"], entry["after"]["min_workers"]) == ("instant", 0, 2)
    bad = client.post("/console/admin/models/instant", headers={"HX-Request": "true", "X-CSRF-Token": csrf},
                      data={"min_workers": "-3"})
    assert bad.status_code == 200 and "greater than or equal to 0" in bad.text
    assert astack.sql("SELECT min_workers FROM models WHERE name = 'instant'") == [(2,)]
    client.post("/console/admin/models/instant", data={"csrf_token": csrf, "min_workers": "0"})
    assert client.post("/console/admin/models/nope", data={"csrf_token": csrf, "pinned": "true"}).status_code == 404


def test_platform_usage_counts_requests_and_revenue(astack, admin) -> None:
    client, _ = admin
    total = lambda: int(re.search(r"Requests, 30 days</div><div class=\"stat-value\">([\d,]+)<",  # noqa: E731
                                  client.get("/console/admin/usage").text).group(1).replace(",", ""))
    first = total()
    assert _chat(astack, astack.api_key).status_code == 200
    eventually(total, lambda n: n == first + 1, "the new request counted on the usage page")
    page = client.get("/console/admin/usage", params={"days": 7}).text
    assert len(re.findall(r'<td class="nowrap">\d{4}-\d\d-\d\d</td>', page)) == 7 and "data-chart=" in page
    assert client.get("/console/admin/usage", params={"days": 0}).status_code == 400
    assert client.get("/console/admin/usage", params={"days": 10_000}).status_code == 400


def _plan_row(page: str, plan: str) -> str:
    """The dashboard's row of ``plan`` in its "Each plan's promise" table."""
    match = re.search(rf'<tr data-plan="{plan}">(.*?)</tr>', page, re.DOTALL)
    assert match, f"no row for {plan} on the dashboard"
    return match.group(1)


def _first_tokens(row: str) -> int:
    return int(re.search(r'<span class="muted">\(([\d,]+)\)</span>', row).group(1).replace(",", ""))


def _quota_refusals(row: str) -> int:
    found = re.search(r"quota ([\d,]+)<", row)
    return int(found.group(1).replace(",", "")) if found else 0


def test_the_dashboard_shows_each_plans_figures_against_its_target(astack, admin) -> None:
    """A premium request lands in the premium row (its first token counted, against premium's target);
    a pro account's quota 429 lands in pro's refusals."""
    client, _ = admin
    premium = astack.cli("keys", "create", "--account", "dash-premium", "--plan", "premium").stdout.strip()
    limited = astack.cli("keys", "create", "--account", "dash-limited", "--plan", "pro").stdout.strip()
    astack.sql("UPDATE accounts SET daily_limit_override = 1 WHERE name = 'dash-limited'")
    page = client.get("/console/admin").text
    before, refused = _first_tokens(_plan_row(page, "premium")), _quota_refusals(_plan_row(page, "pro"))
    assert _chat(astack, premium).status_code == 200
    assert _chat(astack, limited).status_code == 200
    assert _chat(astack, limited).status_code == 429

    def read() -> str:
        return client.get("/console/admin").text

    page = eventually(read, lambda p: _first_tokens(_plan_row(p, "premium")) == before + 1
                      and _quota_refusals(_plan_row(p, "pro")) == refused + 1, "the requests on the dashboard")
    row = _plan_row(page, "premium")
    assert "5.00 s" in row and "2.00 s" in row  # premium's targets (gateway settings' defaults)
    assert "Each plan's promise" in page


def test_the_audit_log_is_paged_newest_first(astack, admin) -> None:
    client, _ = admin
    for limit in range(1, 56):
        assert astack.api.patch("/plans/free", json={"max_output_tokens": 500 + limit}).status_code == 200
    first = client.get("/console/admin/audit").text
    shown = re.compile(r'plan <strong>free</strong>.*?max_output_tokens</span> <span class="old">\d+</span> → '
                       r'<span class="new">(\d+)</span>', re.S)
    ids = [int(i) for i in shown.findall(first)]
    assert ids[:3] == [555, 554, 553]
    older = re.search(r'href="/console/admin/audit\?before=(\d+)"', first)
    assert older, "no link to older entries"
    second = client.get("/console/admin/audit", params={"before": older.group(1)}).text
    assert "Newest" in second
    assert client.get("/console/admin/audit", params={"action": "plan.update"}).status_code == 200
    assert client.get("/console/admin/audit", params={"before": -1}).status_code == 400
    assert client.get("/console/admin/audit", params={"action": "x" * 65}).status_code == 400
    assert client.get("/console/admin/accounts", params={"q": "x" * 129}).status_code == 400
    astack.api.patch("/plans/free", json={"max_output_tokens": 512})


# -- in a real browser (Debian's Chromium through Playwright: tests/console/conftest.py) -------

DEMO_ACCOUNTS = [("acme-robotics", "premium", 14), ("globex", "pro", 9), ("initech", "free", 0),
                 ("umbrella-labs", "enterprise", 6), ("hooli", "trial", 3)]


SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"


def screenshot(page, name: str, tmp_path) -> None:  # noqa: ANN001 - a Playwright Page
    """What the browser shows (1280x900, no full-page stitching: the sidebar is sticky), into
    docs/screenshots with FLATFARE_TEST_SCREENSHOTS=1 (README shows them)."""
    folder = SCREENSHOTS if os.environ.get("FLATFARE_TEST_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"))


@pytest.fixture(scope="module")
def populated(astack) -> None:
    """A few accounts made through the admin API, each with a key and some real requests (the instant
    engine answers at once), so the pages show a platform in use."""
    for name, plan, requests in DEMO_ACCOUNTS:
        made = astack.api.post("/accounts", json={"name": name, "plan": plan,
                                                  **({"unlimited": True} if plan == "enterprise" else {})})
        assert made.status_code == 201, made.text
        key = astack.api.post(f"/accounts/{made.json()['id']}/keys", json={"name": "production"}).json()["key"]
        for _ in range(requests):
            assert _chat(astack, key).status_code == 200
    soylent = astack.api.post("/accounts", json={"name": "soylent", "plan": "pro"}).json()
    astack.api.patch(f"/accounts/{soylent['id']}", json={"status": "suspended"})


def test_an_admin_changes_a_plans_daily_limit_in_the_browser_and_the_customer_sees_it(  # noqa: PLR0915
        astack, populated, page, tmp_path) -> None:  # noqa: ANN001
    base = astack.base_url
    customer_id = astack.customer_account
    original = astack.api.get("/accounts/" + str(customer_id)).json()["plan"]
    limit_before = astack.api.get(f"/plans/{original}").json()["daily_limit"]
    key = astack.api.post(f"/accounts/{customer_id}/keys", json={"name": "laptop"}).json()["key"]

    def usage_limit() -> int | None:
        answer = httpx.get(f"{base}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()["today"]["limit"]

    assert usage_limit() == limit_before
    new_limit = limit_before + 77
    page.set_viewport_size({"width": 1280, "height": 900})
    # Anything the page's scripts or the CSP refuse (an inline style or script) shows up here.
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    try:
        page.goto(f"{base}/console/login?admin=1")
        page.fill("input[name=admin_token]", astack.admin_token)
        page.click("button:has-text('Sign in')")
        page.wait_for_url(f"{base}/console/admin")
        screenshot(page, "admin-dashboard", tmp_path)

        page.click("nav >> text=Accounts")
        page.wait_for_url(f"{base}/console/admin/accounts")
        screenshot(page, "admin-accounts", tmp_path)
        page.fill("input[name=q]", "acme")  # htmx searches as one types
        page.locator("#account-rows >> text=globex").wait_for(state="detached")
        page.click("#account-rows >> text=acme-robotics")
        page.wait_for_url(re.compile(r".*/console/admin/accounts/\d+$"))
        screenshot(page, "admin-account", tmp_path)
        acme = int(page.url.rsplit("/", 1)[1])
        page.select_option("#account-summary select[name=plan]", "pro")
        page.click("#account-summary button:has-text('Change plan')")  # htmx swaps the summary in place
        page.locator("#account-summary >> text=The account's plan was changed.").wait_for()
        assert astack.sql("SELECT plan FROM accounts WHERE id = :i", i=acme) == [("pro",)]
        assert audit_entries(astack, "account.update")[0]["after"]["plan"] == "pro"

        page.click("nav >> text=Plans")
        page.wait_for_url(f"{base}/console/admin/plans")
        screenshot(page, "admin-plans", tmp_path)
        card = page.locator(f"#plan-{original}")
        card.locator("text=Edit").click()
        form = page.locator(f"form#plan-{original}")
        form.wait_for()
        # A value the admin API would refuse is refused here, beside its field, and nothing is saved.
        form.locator("input[name=daily_limit]").fill("-5")
        form.locator("button:has-text('Save plan')").click()
        form.locator(".field-error").wait_for()
        assert "greater than or equal to 0" in form.locator(".field-error").inner_text()
        form.locator("h3").scroll_into_view_if_needed()
        page.mouse.wheel(0, -60)
        screenshot(page, "admin-plan-edit", tmp_path)
        assert usage_limit() == limit_before
        form.locator("input[name=daily_limit]").fill(str(new_limit))
        form.locator("button:has-text('Save plan')").click()
        page.locator(f"article#plan-{original} [data-field=daily_limit]").wait_for()
        assert page.locator(f"article#plan-{original} [data-field=daily_limit]").inner_text() == f"{new_limit:,}"

        entry = audit_entries(astack, "plan.update")[0]
        assert (entry["actor"], entry["resource_id"]) == ("ops", original)
        assert (entry["before"]["daily_limit"], entry["after"]["daily_limit"]) == (limit_before, new_limit)
        # The customer sees it: /v1/usage with their key, and their console's overview.
        eventually(usage_limit, lambda limit: limit == new_limit, "the new limit in /v1/usage")
        customer, _ = customer_login(base)
        assert f"{new_limit:,}" in customer.get("/console").text
        customer.close()

        for name in ("models", "usage", "audit"):
            page.click(f"nav >> text={ {'models': 'Models', 'usage': 'Platform usage', 'audit': 'Audit log'}[name] }")
            page.wait_for_url(f"{base}/console/admin/{name}")
            if name == "usage":
                page.locator("canvas[data-chart]").wait_for()
            screenshot(page, f"admin-{name}", tmp_path)
            if name == "models":
                row = page.locator("#model-rows tr", has_text="instant").first
                row.locator("button[aria-label='One more']").click()
                page.locator("#model-rows tr", has_text="instant").first.locator(".step-value", has_text="1").wait_for()
                assert astack.sql("SELECT min_workers FROM models WHERE name = 'instant'") == [(1,)]
                astack.api.patch("/models/instant", json={"min_workers": 0})
        assert page.locator("td >> text=plan.update").count() >= 1
        assert problems == []
    finally:
        astack.api.patch(f"/plans/{original}", json={"daily_limit": limit_before})


INVITE_LINK = re.compile(r"/console/invite/[A-Za-z0-9_-]{43}")


def _invite_link(astack, email: str) -> str:
    """The invitation's link (its path on this stack: the email names the gateway's public_url)."""
    def links() -> list[str]:
        log = (astack.logs / "gateway.log").read_text(errors="replace")
        return [INVITE_LINK.search(line).group(0) for line in log.splitlines()
                if LOG_MARK in line and f"to={email}" in line and INVITE_LINK.search(line)]

    return astack.base_url + eventually(links, bool, f"the invitation for {email} in the gateway's log")[-1]


def test_a_team_in_the_browser_invite_accept_key_remove_revokes(  # noqa: ANN001, PLR0915
        astack, admin, page, browser, tmp_path) -> None:
    """Teams, the whole way: an owner invites a developer by email, who accepts in a browser of their own
    (signing up through the link) and makes a key that the openai SDK can use; the owner sees who made
    it, removes the developer, and the key is refused (401) from then on; the admin API and the admin
    console list the account's members, the API its audit entries. Takes the team page's screenshots (1280 and 390 px wide)."""
    base = astack.base_url
    owner_email, dev_email = f"owner-{os.urandom(4).hex()}@example.com", f"dev-{os.urandom(4).hex()}@example.com"
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("dialog", lambda dialog: dialog.accept())  # the Remove confirmation
    clear_attempts(astack.redis_url)
    page.goto(f"{base}/console/signup")
    page.fill("input[name=email]", owner_email)
    page.fill("input[name=password]", PASSWORD)
    page.click("button:has-text('Create account')")
    page.wait_for_url(f"{base}/console?done=welcome")
    account_id = astack.sql("SELECT account_id FROM console_users WHERE email = :e", e=owner_email)[0][0]

    page.click("nav >> text=Team")
    page.fill("#invite-form input[name=email]", dev_email)
    page.select_option("#invite-form select[name=role]", "developer")
    page.click("#invite-form button[type=submit]")
    page.wait_for_url(f"{base}/console/team?done=invited")
    link = _invite_link(astack, dev_email)

    member = browser.new_context(viewport={"width": 1280, "height": 800})
    member.set_default_timeout(60_000)
    try:
        dev = member.new_page()
        dev.goto(link)
        dev.fill("#accept-invite input[name=password]", PASSWORD)
        dev.click("#accept-invite button[type=submit]")
        dev.wait_for_url(f"{base}/console?done=joined")
        assert dev.locator("nav >> text=Plan & billing").count() == 0  # a developer: keys and usage
        dev.click("nav >> text=API keys")
        dev.fill("#create-key input[name=name]", "dev laptop")
        dev.click("#create-key button[type=submit]")
        secret = dev.locator("#new-secret").inner_text().strip()
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0, timeout=30)
        assert sdk.models.list().data is not None
        dev.goto(link)  # the link worked once
        assert "already used" in dev.locator("#invite-problem").inner_text()

        page.goto(f"{base}/console/keys")
        row = page.locator("#keys-table tr", has_text="dev laptop")
        assert row.locator("[data-field=made_by]").inner_text() == dev_email
        page.goto(f"{base}/console/team")
        for width, name in ((1280, "console-team"), (390, "console-team-390")):
            page.set_viewport_size({"width": width, "height": 900})
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), f"{width} px scrolls"
            console_screenshot(page, name, tmp_path)
        page.set_viewport_size({"width": 1280, "height": 900})
        dev_row = page.locator(f"#members-table tr[data-member='{dev_email}']")
        assert dev_row.locator("select[name=move_keys_to]").input_value() == ""  # revoke their keys
        dev_row.locator("button:has-text('Remove')").click()
        page.wait_for_url(f"{base}/console/team?done=removed")
        assert page.locator(f"#members-table tr[data-member='{dev_email}']").count() == 0

        def refused() -> bool:
            try:
                sdk.models.list()
            except openai.AuthenticationError:
                return True
            return False

        eventually(refused, bool, "the removed member's key refused")
        dev.goto(f"{base}/console/keys")
        dev.wait_for_url(f"{base}/console/login")  # their session ended with the membership
    finally:
        member.close()
    members = astack.api.get(f"/accounts/{account_id}/members").json()["data"]
    assert [(m["email"], m["role"]) for m in members] == [(owner_email, "owner")]
    admin_page = admin[0].get(f"/console/admin/accounts/{account_id}").text
    listed = admin_page.split('id="account-members"')[1].split("</section>")[0]
    assert owner_email in listed and ">owner<" in listed and dev_email not in listed
    actions = [e["action"] for e in astack.api.get("/audit", params={"account_id": account_id}).json()["data"]]
    assert actions[::-1] == ["member.invite", "member.join", "key.create", "key.revoke", "member.remove"], actions
    assert not problems, problems
