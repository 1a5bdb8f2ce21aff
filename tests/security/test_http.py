"""Every class of bad input through the running platform (gateway, Redis, SQLite, the instant
engine): a clear 4xx in OpenAI's error envelope within 100 ms (OVER_HTTP_S seen from the client:
tests/security/timing.py), no ledger row, no quota unit, and the engine keeps serving. The request
validation behind most of these is tested without HTTP in test_limits.py and test_media.py; here the
whole path is."""

from __future__ import annotations

import base64
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.billing.quota import counter_key
from tests.conftest import Stack, launch_admin_stack
from tests.security.test_limits import json_schema, nested
from tests.security.test_media import data_url, png
from tests.security.timing import fast_over_http

pytestmark = pytest.mark.e2e

MODEL = "instant"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_admin_stack(tmp_path_factory.mktemp("security"), "security") as stack:
        yield stack


@pytest.fixture(scope="module")
def http(sstack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sstack.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {sstack.api_key}"}) as client:
        assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).status_code == 200  # warm
        yield client


def account_id(stack: Stack, name: str = "e2e") -> int:
    return stack.sql("SELECT id FROM accounts WHERE name = :name", name=name)[0][0]


def quota_used(stack: Stack, account: int) -> int:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        return int(client.get(counter_key(account, quota_window("UTC", datetime.now(UTC)).day)) or 0)
    finally:
        client.close()


def ledger_rows(stack: Stack) -> int:
    return stack.sql("SELECT count(*) FROM requests")[0][0]


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def timed(send: Any, *args: Any, **kwargs: Any) -> httpx.Response:
    """The response to a request that must be refused within OVER_HTTP_S (tests/security/timing.py)."""
    return fast_over_http(lambda: send(*args, **kwargs))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def with_image(url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


IMAGE = "messages[0].content[1].image_url.url"
BAD_BODIES = {
    "n": (chat(n=10_000), "n", None),
    "best_of": (chat(best_of=1000), "best_of", None),
    "top_logprobs": (chat(logprobs=True, top_logprobs=1000), "top_logprobs", None),
    "huge schema": (chat(response_format=json_schema(nested(10))), "response_format", "schema_too_large"),
    "deep schema": (chat(response_format=json_schema(deep(40))), None, "schema_too_deep"),
    "catastrophic regex": (chat(structured_outputs={"regex": "(.{0,16}){0,16}"}), "structured_outputs.regex",
                           "pattern_too_complex"),
    "catastrophic pattern": (chat(response_format=json_schema({"type": "string", "pattern": "(.{0,8}){0,8}"})),
                             "response_format.json_schema.schema.pattern", "pattern_too_complex"),
    "remote $ref": (chat(response_format=json_schema({"$ref": "http://169.254.169.254/"})), None, "invalid_schema"),
    "tools": (chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]), "tools", None),
    "stop": (chat(stop=["x" * 10_000]), "stop", None),
    "chat_template": (chat(chat_template="{% for i in range(10**9) %}x{% endfor %}"), "chat_template",
                      "unsupported_parameter"),
    "metadata IP": (with_image("http://169.254.169.254/latest/meta-data/iam/"), IMAGE, "invalid_image_url"),
    "loopback": (with_image("http://127.0.0.1:6379/"), IMAGE, "invalid_image_url"),
    "private": (with_image("http://10.0.0.1/a.png"), IMAGE, "invalid_image_url"),
    "link-local v6": (with_image("http://[fe80::1]/a.png"), IMAGE, "invalid_image_url"),
    "mapped v6": (with_image("http://[::ffff:169.254.169.254]/"), IMAGE, "invalid_image_url"),
    "decimal IP": (with_image("http://2130706433/"), IMAGE, "invalid_image_url"),
    "localhost name": (with_image("http://localhost/a.png"), IMAGE, "invalid_image_url"),
    "file": (with_image("file:///etc/passwd"), IMAGE, "invalid_image_url"),
    "image bomb": (with_image(data_url(png(100_000, 100_000))), IMAGE, "image_too_large"),
    "not an image": (with_image("data:image/png;base64," + base64.b64encode(b"<script>").decode()), IMAGE,
                     "invalid_image_format"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_bodies_are_refused_fast_and_free(sstack: Stack, http: httpx.Client, case: str) -> None:
    body, param, code = BAD_BODIES[case]
    account = account_id(sstack)
    rows, used = ledger_rows(sstack), quota_used(sstack, account)
    assert_error(timed(http.post, "/v1/chat/completions", json=body), 400, param=param, code=code)
    assert (ledger_rows(sstack), quota_used(sstack, account)) == (rows, used)


@pytest.mark.parametrize("payload", ["' OR '1'='1' -- ", "'; DROP TABLE api_keys; --", "\" UNION SELECT 1 --"])
def test_sql_through_the_bearer_header_is_a_401(sstack: Stack, payload: str) -> None:
    key = "ff-" + (payload * 43)[:43]
    for path in ("/v1/chat/completions", "/v1/models", "/v1/usage"):
        send = httpx.post if path.endswith("completions") else httpx.get
        kwargs = {"json": chat()} if send is httpx.post else {}
        response = timed(send, sstack.base_url + path, headers={"Authorization": f"Bearer {key}"}, **kwargs)
        assert_error(response, 401, code="invalid_api_key")
    admin = timed(httpx.get, f"{sstack.base_url}/admin/v1/accounts",
                  headers={"Authorization": f"Bearer ffa-{(payload * 43)[:43]}"})
    assert_error(admin, 401, code="invalid_admin_token")
    assert sstack.sql("SELECT count(*) FROM api_keys")[0][0] >= 1


def raw_request(stack: Stack, head: bytes) -> bytes:
    """Send exactly ``head`` (no client normalising the path) and read the response's start."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(head)
        return conn.recv(65536)


def test_oversized_headers_are_refused_and_the_gateway_keeps_serving(sstack: Stack, http: httpx.Client) -> None:
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n"
    many = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n"
    for head in (big, many):
        answer = fast_over_http(lambda head=head: raw_request(sstack, head))
        assert answer.split(b" ", 2)[1] in (b"400", b"413", b"431"), f"{len(head)} bytes: {answer[:12]!r}"
    assert http.get("/v1/models").status_code == 200
    # uvicorn's parser takes any size; the gateway's outermost layer answers 431 (gateway/openai/asgi.py).


PATH_TRICKS = [b"/admin/v1/../v1/models", b"/v1/../admin/v1/accounts", b"/admin/v1/%2e%2e/admin/v1/accounts",
               b"//admin/v1/accounts", b"/admin/v1//accounts", b"/ADMIN/v1/accounts", b"/admin/v1/./accounts",
               b"/admin/v1/models/..%2F..%2Faccounts", b"/admin/v1/models/../../accounts", b"/admin/v1/accounts%00",
               b"/admin/v1/accounts;/", b"/admin/v1/accounts?x=/../",
               b"/admin/v1/accounts/1/keys/..%2f..%2f..%2ftokens"]


@pytest.mark.parametrize("target", PATH_TRICKS)
def test_path_tricks_never_reach_admin_data(sstack: Stack, target: bytes) -> None:
    for credential in (b"", b"Authorization: Bearer " + sstack.api_key.encode() + b"\r\n"):
        answer = raw_request(sstack, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + credential + b"\r\n")
        status = answer.split(b" ", 2)[1]
        assert status in (b"400", b"401", b"403", b"404", b"405"), answer[:300]
        assert b'"data"' not in answer and b"e2e" not in answer


def test_a_read_only_admin_token_cannot_write_through_path_tricks(sstack: Stack) -> None:
    writer = {"Authorization": f"Bearer {sstack.admin_token}"}
    made = httpx.post(f"{sstack.base_url}/admin/v1/tokens", json={"name": "reader", "scopes": ["admin:read"]},
                      headers=writer)
    assert made.status_code == 201, made.text
    reader = b"Authorization: Bearer " + made.json()["token"].encode() + b"\r\n"
    for method, target in ((b"DELETE", b"/admin/v1/keys/1/../../tokens/1"), (b"DELETE", b"/admin/v1/tokens/1"),
                           (b"POST", b"/admin/v1/tokens/../tokens"), (b"PATCH", b"/admin/v1/accounts/1")):
        answer = raw_request(sstack, method + b" " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                             + b"Content-Type: application/json\r\n" + reader + b"\r\n{}")
        assert answer.split(b" ", 2)[1] in (b"403", b"404", b"405"), answer[:300]
    assert sstack.sql("SELECT count(*) FROM admin_tokens WHERE revoked_at IS NOT NULL")[0][0] == 0


def test_a_trailing_slash_redirect_does_not_follow_the_host_header(sstack: Stack) -> None:
    answer = raw_request(sstack, b"GET /admin/v1/accounts/ HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    assert b"evil.example" not in answer


def _gateway_lines(stack: Stack, offset: int) -> list[dict[str, Any]]:
    """The gateway's JSON log lines written past byte ``offset`` of its log."""
    with (stack.logs / "gateway.log").open("rb") as log:
        log.seek(offset)
        return [json.loads(line) for line in log.read().decode(errors="replace").splitlines() if line.startswith("{")]


def test_keys_never_reach_the_logs(sstack: Stack, http: httpx.Client) -> None:
    unknown = "ff-" + "Q" * 43
    base = sstack.base_url
    offset = (sstack.logs / "gateway.log").stat().st_size
    sent = [
        ("POST", "/v1/chat/completions", httpx.post(f"{base}/v1/chat/completions", json=chat(),
                                                     headers={"Authorization": f"Bearer {unknown}"})),
        ("GET", "/v1/models", httpx.get(f"{base}/v1/models?api_key={sstack.api_key}")),
        ("POST", "/v1/chat/completions", http.post("/v1/chat/completions", json=chat(
            messages=[{"role": "user", "content": f"my key is {sstack.api_key}"}]))),
        ("POST", "/v1/chat/completions", http.post("/v1/chat/completions", json=chat(model=sstack.api_key))),
        ("POST", "/v1/chat/completions", http.post("/v1/chat/completions",
                                                   content=f'{{"model": "{sstack.api_key}", '.encode())),
        ("GET", "/v1/models", httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {sstack.admin_token}"})),
        ("GET", "/admin/v1/accounts", httpx.get(f"{base}/admin/v1/accounts",
                                                headers={"Authorization": f"Bearer {sstack.api_key}"})),
    ]
    # Each request's own line, by what it says (and the answered one by its request id): a line is
    # written once the request's bookkeeping is done, after its answer may have reached the client.
    wanted = Counter(f"{method} {path} {response.status_code}" for method, path, response in sent)
    answered = sent[2][2].headers["x-request-id"]
    deadline = time.monotonic() + 20
    while True:
        lines = _gateway_lines(sstack, offset)
        if wanted <= Counter(line["message"] for line in lines) and any(
                line.get("request_id") == answered for line in lines):
            break
        assert time.monotonic() < deadline, f"the gateway never logged {wanted}: {[x['message'] for x in lines]}"
        time.sleep(0.1)
    logs = "".join(path.read_text(errors="replace") for path in sstack.logs.glob("*.log"))
    for secret in (sstack.api_key, unknown, sstack.admin_token):
        assert secret not in logs
        assert secret[11:] not in logs  # nor the secret part behind the visible prefix


def test_one_account_cannot_read_anothers_usage(sstack: Stack, http: httpx.Client) -> None:
    created = sstack.cli("keys", "create", "--account", "usage-other", "--plan", "pro")
    assert created.returncode == 0, created.stderr
    other = {"Authorization": f"Bearer {created.stdout.strip()}"}
    mine = http.get("/v1/usage").json()
    assert mine["account"] == "e2e" and mine["today"]["requests"] > 0
    victim = account_id(sstack)
    for query in ("", f"?account_id={victim}", "?account=e2e", f"?account_id={victim}&account=e2e"):
        theirs = httpx.get(f"{sstack.base_url}/v1/usage{query}", headers=other).json()
        assert theirs["account"] == "usage-other" and theirs["today"]["requests"] == 0
        assert all(day["requests"] == 0 for day in theirs["daily"])


def test_one_account_cannot_replay_anothers_idempotent_request(sstack: Stack, http: httpx.Client) -> None:
    created = sstack.cli("keys", "create", "--account", "replay-other", "--plan", "pro")
    assert created.returncode == 0, created.stderr
    other = {"Authorization": f"Bearer {created.stdout.strip()}", "Idempotency-Key": "shared-key-1"}
    body = chat(messages=[{"role": "user", "content": "a private question"}])
    first = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "shared-key-1"})
    assert first.status_code == 200
    replay = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "shared-key-1"})
    assert replay.headers["x-request-id"] == first.headers["x-request-id"]  # the owner's own replay works
    same = httpx.post(f"{sstack.base_url}/v1/chat/completions", json=body, headers=other, timeout=30)
    changed = httpx.post(f"{sstack.base_url}/v1/chat/completions", json=chat(), headers=other, timeout=30)
    assert same.status_code == 200 and same.headers["x-request-id"] != first.headers["x-request-id"]
    # The key is the other account's own now: its different body is a 409 for it, and says nothing of the first.
    assert changed.status_code == 409 and first.headers["x-request-id"] not in changed.text
    owners = dict(sstack.sql("SELECT r.id, a.name FROM requests r JOIN accounts a ON a.id = r.account_id "
                             "WHERE r.idempotency_key = 'shared-key-1'"))
    assert owners == {first.headers["x-request-id"]: "e2e", same.headers["x-request-id"]: "replay-other"}


MASS_ASSIGNMENTS = [
    ("POST", "/accounts", {"name": "mass-1", "plan": "pro", "id": 1}, "id"),
    ("POST", "/accounts", {"name": "mass-2", "plan": "pro", "stripe_customer_id": "cus_x"}, "stripe_customer_id"),
    ("POST", "/accounts", {"name": "mass-3", "status": "active", "created_at": "2020-01-01T00:00:00Z"}, None),
    ("PATCH", "/accounts/{victim}", {"stripe_customer_id": "cus_attacker"}, "stripe_customer_id"),
    ("PATCH", "/accounts/{victim}", {"id": 999}, "id"),
    ("PATCH", "/accounts/{victim}", {"trial_ends_at": "2999-01-01T00:00:00Z"}, "trial_ends_at"),
    ("POST", "/accounts/{victim}/keys", {"name": "k", "key_hash": "0" * 64, "account_id": 1}, None),
    ("POST", "/models", {"name": "evil", "source": "x", "engine_options": {"trust_remote_code": True}},
     "engine_options.trust_remote_code"),
    ("POST", "/models", {"name": "evil", "source": "x", "engine_options": {"allowed_local_media_path": "/"}},
     "engine_options.allowed_local_media_path"),
    ("PATCH", "/plans/pro", {"name": "free"}, "name"),
    ("PATCH", "/plans/pro", {"price_per_request_micros": -1}, "price_per_request_micros"),
    ("POST", "/tokens", {"name": "t", "scopes": ["admin:read"], "created_by": None, "token_hash": "0" * 64}, None),
]


@pytest.mark.parametrize(("method", "path", "body", "param"), MASS_ASSIGNMENTS)
def test_admin_writes_refuse_fields_that_are_not_the_callers(sstack: Stack, method: str, path: str,
                                                             body: dict[str, Any], param: str | None) -> None:
    victim = account_id(sstack)
    before = (sstack.sql("SELECT count(*) FROM audit_log")[0][0],
              sstack.sql("SELECT * FROM accounts ORDER BY id"), sstack.sql("SELECT * FROM plans ORDER BY name"))
    response = timed(httpx.request, method, f"{sstack.base_url}/admin/v1{path.format(victim=victim)}", json=body,
                     headers={"Authorization": f"Bearer {sstack.admin_token}"})
    assert_error(response, 422, param=param)
    after = (sstack.sql("SELECT count(*) FROM audit_log")[0][0],
             sstack.sql("SELECT * FROM accounts ORDER BY id"), sstack.sql("SELECT * FROM plans ORDER BY name"))
    assert after == before


def test_a_flood_of_unique_schemas_gets_429(sstack: Stack) -> None:
    """30 new schemas a minute pass the screen, every one after them is refused; a repeat is free."""
    created = sstack.cli("keys", "create", "--account", "schema-flood", "--plan", "pro")
    assert created.returncode == 0, created.stderr
    with httpx.Client(base_url=sstack.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {created.stdout.strip()}"}) as client:
        def send(i: int) -> httpx.Response:
            return client.post("/v1/chat/completions", json=chat(response_format=json_schema(
                {"type": "object", "properties": {f"p{i}": {"type": "integer"}}})))

        responses = [send(i) for i in range(33)]
        assert [r.status_code for r in responses] == [200] * 30 + [429] * 3
        for refused in responses[30:]:
            assert_error(refused, 429, code="too_many_new_schemas")
            assert int(refused.headers["retry-after"]) >= 1
        assert send(0).status_code == 200  # seen this minute: not new


def test_a_name_that_does_not_resolve_is_refused(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=with_image("https://no-such-host.flatfare-security-test-zz/"))
    assert_error(response, 400, param=IMAGE, code="invalid_image_url")


def test_the_engine_keeps_serving(http: httpx.Client) -> None:
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json=chat(stream=stream, max_tokens=4))
        assert response.status_code == 200, response.text
