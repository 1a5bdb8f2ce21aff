"""The admin API through httpx against a running gateway, on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import redis as redis_sync

from flatfare.billing.plans import quota_window
from flatfare.contract import key_quota_counter_key, quota_counter_key
from flatfare.redis_local import free_port
from tests.conftest import eventually, launch_stack, postgres_database

pytestmark = pytest.mark.e2e

MODEL = "instant"
MESSAGES = [{"role": "user", "content": "hi"}]


class Admin:
    def __init__(self, base_url: str, token: str) -> None:
        self.http = httpx.Client(base_url=f"{base_url}/admin/v1", headers={"Authorization": f"Bearer {token}"},
                                 timeout=30)

    def __getattr__(self, name: str):  # get/post/patch/delete
        return getattr(self.http, name)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def astack(request, tmp_path_factory):
    database = postgres_database() if request.param == "postgresql" else iter([None])
    url = next(database)
    try:
        with launch_stack(tmp_path_factory.mktemp(f"admin-{request.param}"), model=MODEL,
                          worker_args=("--engine", "instant"), database_url=url,
                          env={"FLATFARE_PLANS_CACHE_TTL_S": "0.3"}) as stack:
            token = stack.cli("admin", "bootstrap", "--name", "ops")
            assert token.returncode == 0, token.stderr
            stack.admin_token = token.stdout.strip()
            # A second gateway process on its own port: changes must reach it too.
            port = free_port()
            second = subprocess.Popen([sys.executable, "-m", "flatfare", "gateway", "--port", str(port)],
                                      env=stack.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.second_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{stack.second_url}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the second gateway did not answer /healthz within 30 s"
                time.sleep(0.2)
            try:
                yield stack
            finally:
                second.terminate()
                second.wait(60)
    finally:
        for _ in database:  # drops the PostgreSQL database
            pass


@pytest.fixture(scope="module")
def admin(astack) -> Admin:
    return Admin(astack.base_url, astack.admin_token)


def _chat(base_url: str, key: str, model: str = MODEL) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, "messages": MESSAGES},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _audit_actions(admin: Admin) -> list[str]:
    return [e["action"] for e in admin.get("/audit", params={"limit": 200}).json()["data"]]


def test_credentials_and_scopes(astack, admin) -> None:
    assert httpx.get(f"{astack.base_url}/admin/v1/plans").status_code == 401
    with_key = httpx.get(f"{astack.base_url}/admin/v1/plans", headers={"Authorization": f"Bearer {astack.api_key}"})
    assert with_key.status_code == 403 and with_key.json()["error"]["code"] == "api_key_not_allowed"
    reader = admin.post("/tokens", json={"name": "dashboards", "scopes": ["admin:read"]}).json()
    assert reader["token"].startswith("ffa-") and reader["scopes"] == ["admin:read"]
    read_only = Admin(astack.base_url, reader["token"])
    assert read_only.get("/plans").status_code == 200
    refused = read_only.patch("/plans/free", json={"daily_limit": 1})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    escalate = read_only.post("/tokens", json={"name": "x", "scopes": ["admin:write"]})
    assert escalate.status_code == 403
    listed = admin.get("/tokens").json()["data"]
    assert all("token" not in t and "token_hash" not in t for t in listed)
    # An admin token is not an API key either.
    assert _chat(astack.base_url, reader["token"]).status_code == 401


def test_plans_crud_takes_effect_on_the_next_request(astack, admin) -> None:
    created = admin.post("/plans", json={"name": "gold", "display_name": "Gold", "daily_limit": 100,
                                         "price_per_request_micros": 1000, "lane": "premium"})
    assert created.status_code == 201 and created.json()["daily_limit"] == 100
    assert admin.post("/plans", json={"name": "gold", "display_name": "Again"}).status_code == 409
    account = admin.post("/accounts", json={"name": "goldie", "plan": "gold"}).json()
    key = admin.post(f"/accounts/{account['id']}/keys", json={"name": "main"}).json()["key"]
    assert _chat(astack.base_url, key).headers["x-ratelimit-limit-requests"] == "100"
    assert admin.patch("/plans/gold", json={"daily_limit": 250}).json()["daily_limit"] == 250
    for base in (astack.base_url, astack.second_url):  # once the plans cache of every gateway process expired
        eventually(lambda base=base: _chat(base, key), lambda r: r.headers["x-ratelimit-limit-requests"] == "250",
                   f"the new daily limit at {base}")
    in_use = admin.delete("/plans/gold")
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "plan_in_use"
    assert admin.patch("/plans/gold", json={"retired": True}).json()["retired"] is True
    admin.post("/plans", json={"name": "tmp", "display_name": "Temporary"})
    assert admin.delete("/plans/tmp").status_code == 204
    assert admin.get("/plans/tmp").status_code == 404


def test_an_edited_prompt_cap_takes_effect(astack, admin) -> None:
    assert admin.get("/plans/free").json()["max_prompt_tokens"] == 4096  # seeded
    assert admin.post("/plans", json={"name": "terse", "display_name": "Terse"}).json()["max_prompt_tokens"] is None
    account = admin.post("/accounts", json={"name": "terse-co", "plan": "terse"}).json()
    key = admin.post(f"/accounts/{account['id']}/keys", json={"name": "main"}).json()["key"]
    # 1000 bytes: the instant engine publishes no tokenizer, so a quarter of them, ~250 tokens, is the count.
    long = [{"role": "user", "content": "word " * 200}]

    def send(base: str) -> httpx.Response:
        return httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": long},
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)

    # Polled: a plan created within the plans cache's lifetime is unknown to a gateway until it expires.
    eventually(lambda: send(astack.base_url), lambda r: r.status_code == 200, "the new plan's first request")
    assert admin.patch("/plans/terse", json={"max_prompt_tokens": 100}).json()["max_prompt_tokens"] == 100
    for base in (astack.base_url, astack.second_url):  # once the plans cache of every gateway process expired
        refused = eventually(lambda base=base: send(base), lambda r: r.status_code == 400,
                             f"the new prompt cap at {base}")
        assert refused.json()["error"]["code"] == "prompt_too_long"
        assert "the terse plan allows at most 100 input tokens" in refused.json()["error"]["message"]
    assert admin.patch("/plans/terse", json={"max_prompt_tokens": None}).json()["max_prompt_tokens"] is None
    eventually(lambda: send(astack.base_url), lambda r: r.status_code == 200, "the cap lifted")


def test_batch_and_embedding_columns_are_created_patched_read_and_audited(admin) -> None:
    created = admin.post("/plans", json={"name": "bulk", "display_name": "Bulk", "batch_discount_percent": 30,
                                         "batch_daily_limit": 500, "max_embedding_inputs": 64}).json()
    assert (created["batch_discount_percent"], created["batch_daily_limit"], created["max_embedding_inputs"]) == (
        30, 500, 64)
    defaults = admin.post("/plans", json={"name": "bulk-default", "display_name": "Bulk default"}).json()
    assert (defaults["batch_discount_percent"], defaults["batch_daily_limit"]) == (50, None)  # the columns' defaults
    patched = admin.patch("/plans/bulk", json={"batch_discount_percent": 0, "batch_daily_limit": None}).json()
    assert (patched["batch_discount_percent"], patched["batch_daily_limit"]) == (0, None)
    read = admin.get("/plans/bulk").json()
    assert (read["batch_discount_percent"], read["batch_daily_limit"], read["max_embedding_inputs"]) == (0, None, 64)
    audit = admin.get("/audit", params={"resource_type": "plan", "resource_id": "bulk"}).json()["data"]
    update = next(entry for entry in audit if entry["action"] == "plan.update")
    assert (update["before"]["batch_discount_percent"], update["after"]["batch_discount_percent"]) == (30, 0)
    assert (update["before"]["batch_daily_limit"], update["after"]["batch_daily_limit"]) == (500, None)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/plans/pro", {"daily_limit": -1}, "daily_limit"),
        ("/plans/pro", {"timezone": "Mars/Olympus"}, "timezone"),
        ("/plans/pro", {"name": "renamed"}, "name"),
        ("/plans/pro", {"lane": "fast"}, "lane"),
        ("/plans/pro", {"max_prompt_tokens": 0}, "max_prompt_tokens"),
        ("/plans/pro", {"max_prompt_tokens": 10_000_001}, "max_prompt_tokens"),
        ("/plans/pro", {"max_inflight": 0}, "max_inflight"),
        ("/plans/pro", {"max_inflight": 100_001}, "max_inflight"),
        ("/plans/pro", {"batch_discount_percent": -1}, "batch_discount_percent"),
        ("/plans/pro", {"batch_discount_percent": 101}, "batch_discount_percent"),
        ("/plans/pro", {"batch_discount_percent": None}, "batch_discount_percent"),
        ("/plans/pro", {"batch_daily_limit": 0}, "batch_daily_limit"),
        ("/plans/pro", {"max_embedding_inputs": 0}, "max_embedding_inputs"),
        ("/accounts/1", {"max_inflight_override": 0}, "max_inflight_override"),
        ("/accounts/1", {"max_inflight_override": 100_001}, "max_inflight_override"),
        ("/models/smollm2-135m-instruct", {"engine_options": {"quantization": "magic"}},
         "engine_options.quantization"),
        ("/models/smollm2-135m-instruct", {"engine_options": {"tensor_parallel_size": 0}},
         "engine_options.tensor_parallel_size"),
        ("/models/smollm2-135m-instruct", {"created_at": "2020-01-01"}, "created_at"),
    ],
)
def test_invalid_or_forbidden_fields_get_422_naming_them(admin, path, body, param) -> None:
    before = admin.get(path).json()
    response = admin.patch(path, json=body)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == param
    assert admin.get(path).json() == before


def test_accounts_with_forbidden_fields_and_unknown_ids(admin) -> None:
    assert admin.post("/accounts", json={"name": "x", "id": 99}).status_code == 422
    assert admin.post("/accounts", json={"name": "x", "stripe_customer_id": "cus_1"}).status_code == 422
    assert admin.post("/accounts", json={"name": "x", "plan": "platinum"}).status_code == 422
    assert admin.get("/accounts/999999").status_code == 404
    assert admin.patch("/accounts/999999", json={"status": "suspended"}).status_code == 404
    assert admin.delete("/keys/999999").status_code == 404
    assert admin.get("/models/nope").status_code == 404


def test_a_model_added_through_the_api_appears_once_a_worker_serves_it(astack, admin) -> None:
    added = admin.post("/models", json={"name": "instant-2", "source": "instant", "min_workers": 0,
                                        "engine_options": {"max_model_len": 4096, "enable_prefix_caching": True}})
    assert added.status_code == 201 and added.json()["live_workers"] == 0
    auth = {"Authorization": f"Bearer {astack.api_key}"}
    listed = [m["id"] for m in httpx.get(f"{astack.base_url}/v1/models", headers=auth).json()["data"]]
    assert "instant-2" not in listed
    worker = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--engine", "instant", "--model",
                               "instant-2"], env=astack.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        # Listed from the worker's first heartbeat on ("starting"); requests are taken once it is warm.
        while {m["id"]: m["state"] for m in httpx.get(f"{astack.base_url}/v1/models",
                                                      headers=auth).json()["data"]}.get("instant-2") != "warm":
            assert time.monotonic() < deadline, "the model never appeared"
            time.sleep(0.2)
        assert _chat(astack.base_url, astack.api_key, "instant-2").status_code == 200
        # The model state shows each live worker and the engine configuration it started with.
        shown = eventually(lambda: admin.get("/models/instant-2").json(), lambda m: m["workers"], "the worker listed")
        assert shown["live_workers"] == 1 and shown["workers"][0]["state"] == "warm"
        assert shown["workers"][0]["engine_config"] == {"engine": "instant", "max_model_len": 1 << 20,
                                                        "max_num_seqs": 1024, "tokens": 16}
        assert admin.patch("/models/instant-2", json={"enabled": False}).status_code == 200
        refused = eventually(lambda: _chat(astack.base_url, astack.api_key, "instant-2"),
                             lambda r: r.status_code != 200, "the disabled model refused")
        assert refused.status_code == 404 and "disabled" in refused.json()["error"]["message"]
        admin.patch("/models/instant-2", json={"enabled": True})
        eventually(lambda: _chat(astack.base_url, astack.api_key, "instant-2"), lambda r: r.status_code == 200,
                   "the enabled model served again")
    finally:
        worker.terminate()
        worker.wait(60)  # a loaded machine: its exit, not its speed, is what counts


def test_tensor_parallel_must_divide_the_heads(admin, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    response = admin.post("/models", json={"name": "odd-heads", "source": str(tmp_path),
                                           "engine_options": {"tensor_parallel_size": 2}})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "engine_options.tensor_parallel_size"


def test_keys_shown_once_and_revoked_everywhere(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "acme", "plan": "pro"}).json()
    created = admin.post(f"/accounts/{account['id']}/keys", json={"name": "ci"}).json()
    secret = created["key"]
    keys = admin.get(f"/accounts/{account['id']}/keys").json()["data"]
    assert [k["prefix"] for k in keys] == [secret[:11]] and "key" not in keys[0]
    assert _chat(astack.second_url, secret).status_code == 200
    assert admin.delete(f"/keys/{created['id']}").json()["revoked_at"] is not None
    # Each gateway process caches a key for auth_cache_ttl_s (0.5 s): the revocation must reach the
    # second one; how soon is that cache's documented bound, not something to time on a loaded machine.
    eventually(lambda: _chat(astack.second_url, secret), lambda r: r.status_code == 401,
               "the second gateway refusing the revoked key")


def test_rotation_keeps_the_old_key_for_its_grace_period(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "rotator", "plan": "pro"}).json()
    old = admin.post(f"/accounts/{account['id']}/keys", json={"name": "v1"}).json()
    new = admin.post(f"/keys/{old['id']}/rotate", json={"grace_seconds": 2}).json()
    assert new["key"] != old["key"] and new["account_id"] == account["id"]
    assert _chat(astack.base_url, old["key"]).status_code == 200
    assert _chat(astack.base_url, new["key"]).status_code == 200
    eventually(lambda: _chat(astack.base_url, old["key"]), lambda r: r.status_code == 401,
               "the old key refused once its 2 s grace ended", every_s=0.25)
    assert _chat(astack.base_url, new["key"]).status_code == 200


def test_suspend_and_reactivate(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "flaky", "plan": "pro"}).json()
    key = admin.post(f"/accounts/{account['id']}/keys", json={}).json()["key"]
    assert admin.patch(f"/accounts/{account['id']}", json={"status": "suspended"}).json()["status"] == "suspended"
    eventually(lambda: _chat(astack.base_url, key), lambda r: r.status_code == 403, "the suspended account refused")
    admin.patch(f"/accounts/{account['id']}", json={"status": "active", "plan": "enterprise",
                                                     "daily_limit_override": 20000})
    eventually(lambda: _chat(astack.base_url, key),
               lambda r: r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "20000",
               "the reactivated account served on its new plan")
    filtered = admin.get("/accounts", params={"plan": "enterprise"}).json()["data"]
    assert [a["name"] for a in filtered] == ["flaky"]


def test_usage_totals_match_the_ledger_in_json_and_csv(astack, admin) -> None:
    # A plan with an operator's per-request price (the seeded ones have none), so the amount is counted.
    metered = admin.post("/plans", json={"name": "metered", "display_name": "Metered", "daily_limit": 100,
                                         "price_per_request_micros": 2000, "lane": "standard"})
    assert metered.status_code == 201, metered.text
    account = admin.post("/accounts", json={"name": "counted", "plan": "metered"}).json()
    key = admin.post(f"/accounts/{account['id']}/keys", json={}).json()["key"]
    for _ in range(3):
        assert _chat(astack.base_url, key).status_code == 200
    report = eventually(lambda: admin.get("/usage", params={"account_id": account["id"]}).json(),
                        lambda r: r["totals"]["requests"] >= 3, "the three requests in the usage report")
    assert report["totals"]["requests"] == 3 and report["totals"]["amount_micros"] == 3 * 2000
    ledger = astack.sql("SELECT count(*) FROM requests WHERE account_id = :a AND billable", a=account["id"])
    assert ledger[0][0] == 3
    everything = admin.get("/usage").json()["totals"]["requests"]
    assert everything == astack.sql("SELECT count(*) FROM requests WHERE billable")[0][0]
    rows = list(csv.DictReader(io.StringIO(admin.get("/usage", params={"account_id": account["id"],
                                                                        "format": "csv"}).text)))
    assert sum(int(r["requests"]) for r in rows) == 3 and rows[0]["model"] == MODEL


def test_every_write_is_in_the_audit_log(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "audited"}).json()
    admin.patch(f"/accounts/{account['id']}", json={"status": "suspended"})
    entries = admin.get("/audit", params={"resource_type": "account", "resource_id": str(account["id"])}).json()
    update, create = entries["data"]
    assert (create["action"], update["action"]) == ("account.create", "account.update")
    assert create["before"] is None and create["after"]["name"] == "audited"
    assert (update["before"]["status"], update["after"]["status"]) == ("active", "suspended")
    assert update["actor"] == "ops"
    actions = set(_audit_actions(admin))
    assert {"plan.create", "plan.update", "plan.delete", "model.create", "key.create", "key.revoke",
            "key.rotate", "token.create"} <= actions
    assert not any("key_hash" in json.dumps(e) for e in admin.get("/audit", params={"limit": 200}).json()["data"])


def test_pagination(admin) -> None:
    for i in range(3):
        admin.post("/accounts", json={"name": f"page-{i}"})
    first = admin.get("/accounts", params={"limit": 2, "name_contains": "page-"}).json()
    assert first["has_more"] and len(first["data"]) == 2
    second = admin.get("/accounts", params={"limit": 2, "name_contains": "page-",
                                            "after": first["next_cursor"]}).json()
    assert not second["has_more"] and [a["name"] for a in second["data"]] == ["page-2"]


def test_cli_calls_the_api(astack) -> None:
    env_cli = {"FLATFARE_ADMIN_URL": astack.base_url, "FLATFARE_ADMIN_TOKEN": astack.admin_token}
    astack.env.update(env_cli)
    out = astack.cli("admin", "accounts", "create", "from-cli", "--plan", "pro")
    assert out.returncode == 0, out.stderr
    account_id = json.loads(out.stdout)["id"]
    key = json.loads(astack.cli("admin", "keys", "create", str(account_id)).stdout)["key"]
    assert _chat(astack.base_url, key).status_code == 200
    assert astack.cli("admin", "accounts", "suspend", str(account_id)).returncode == 0
    listed = json.loads(astack.cli("admin", "accounts", "list", "--status", "suspended").stdout)
    assert "from-cli" in [a["name"] for a in listed["data"]]
    assert astack.cli("admin", "usage", "--csv").stdout.startswith("day,account_id")


# -- per-key limits (issue 19 item 3) ------------------------------------------------------------

def _counters(astack, account_id: int, key_id: int) -> tuple[int, int]:
    """Today's (account, key) quota counters in Redis."""
    day = quota_window("UTC", datetime.now(UTC)).day
    client = redis_sync.Redis.from_url(astack.redis_url)
    try:
        return (int(client.get(quota_counter_key(account_id, day)) or 0),
                int(client.get(key_quota_counter_key(key_id, day)) or 0))
    finally:
        client.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_key_limits_are_set_at_creation_changed_validated_and_audited(admin) -> None:
    account = admin.post("/accounts", json={"name": "limited", "plan": "pro"}).json()
    created = admin.post(f"/accounts/{account['id']}/keys", json={
        "name": "ci", "allowed_models": [MODEL, MODEL], "daily_limit": 5, "expires_at": "2099-01-01T00:00:00"})
    assert created.status_code == 201, created.text
    key = created.json()
    assert (key["allowed_models"], key["daily_limit"], key["expires_at"]) == ([MODEL], 5, "2099-01-01T00:00:00Z")
    updated = admin.patch(f"/keys/{key['id']}", json={"daily_limit": 7, "allowed_models": None})
    assert updated.status_code == 200, updated.text
    assert (updated.json()["daily_limit"], updated.json()["allowed_models"]) == (7, None)
    assert updated.json()["name"] == "ci" and updated.json()["expires_at"] == "2099-01-01T00:00:00Z"  # left out: kept
    listed = admin.get(f"/accounts/{account['id']}/keys").json()["data"]
    assert (listed[0]["daily_limit"], listed[0]["allowed_models"]) == (7, None)
    entries = admin.get("/audit", params={"resource_type": "key", "resource_id": str(key["id"])}).json()["data"]
    assert [e["action"] for e in entries] == ["key.update", "key.create"]
    assert (entries[0]["before"]["daily_limit"], entries[0]["after"]["daily_limit"]) == (5, 7)
    assert (entries[0]["before"]["allowed_models"], entries[0]["after"]["allowed_models"]) == ([MODEL], None)
    for body, param in (({"daily_limit": 0}, "daily_limit"), ({"allowed_models": []}, "allowed_models"),
                        ({"allowed_models": [""]}, "allowed_models[0]"),
                        ({"allowed_models": [f"m{i}" for i in range(65)]}, "allowed_models"),
                        ({"name": None}, "name"), ({"key_hash": "0" * 64}, "key_hash"),
                        ({"account_id": 1}, "account_id")):
        refused = admin.patch(f"/keys/{key['id']}", json=body)
        assert refused.status_code == 422 and refused.json()["error"]["param"] == param, (body, refused.text)
    assert admin.post(f"/accounts/{account['id']}/keys", json={"daily_limit": -1}).status_code == 422
    assert admin.patch("/keys/999999", json={"daily_limit": 1}).status_code == 404
    assert admin.get(f"/accounts/{account['id']}/keys").json()["data"][0]["daily_limit"] == 7


def test_a_model_outside_the_keys_list_is_refused_free_and_not_listed(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "narrow", "plan": "pro"}).json()
    key = admin.post(f"/accounts/{account['id']}/keys",
                     json={"name": "only-other", "allowed_models": ["smollm2-135m-instruct"]}).json()
    refused = _chat(astack.base_url, key["key"])
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_allowed_for_key", "model")
    assert "'only-other'" in error["message"] and key["prefix"] in error["message"] and MODEL in error["message"]
    assert _counters(astack, account["id"], key["id"]) == (0, 0)  # refused before anything was counted
    assert astack.sql("SELECT count(*) FROM requests WHERE api_key_id = :k", k=key["id"])[0][0] == 0
    listed = httpx.get(f"{astack.base_url}/v1/models", headers=_auth(key["key"])).json()["data"]
    assert MODEL not in [m["id"] for m in listed]
    assert httpx.get(f"{astack.base_url}/v1/models/{MODEL}", headers=_auth(key["key"])).status_code == 404
    # The account's other keys still see and use it; this one does once the model is on its list.
    assert MODEL in [m["id"] for m in httpx.get(f"{astack.base_url}/v1/models",
                                                 headers=_auth(astack.api_key)).json()["data"]]
    admin.patch(f"/keys/{key['id']}", json={"allowed_models": ["smollm2-135m-instruct", MODEL]})
    for base in (astack.base_url, astack.second_url):
        eventually(lambda base=base: _chat(base, key["key"]), lambda r: r.status_code == 200,
                   f"the widened key served at {base}")


def test_a_rotated_key_keeps_its_limits(admin) -> None:
    account = admin.post("/accounts", json={"name": "rotated-limits", "plan": "pro"}).json()
    old = admin.post(f"/accounts/{account['id']}/keys", json={"allowed_models": [MODEL], "daily_limit": 3}).json()
    new = admin.post(f"/keys/{old['id']}/rotate", json={"grace_seconds": 60}).json()
    assert (new["allowed_models"], new["daily_limit"], new["expires_at"]) == ([MODEL], 3, None)


def test_an_expired_key_is_refused_401(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "expiring", "plan": "pro"}).json()
    past = admin.post(f"/accounts/{account['id']}/keys", json={"expires_at": "2020-01-01T00:00:00Z"}).json()
    refused = _chat(astack.base_url, past["key"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "expired" in refused.json()["error"]["message"]
    live = admin.post(f"/accounts/{account['id']}/keys", json={"expires_at": "2099-01-01T00:00:00Z"}).json()
    assert _chat(astack.base_url, live["key"]).status_code == 200
    admin.patch(f"/keys/{live['id']}", json={"expires_at": "2020-01-01T00:00:00Z"})
    for base in (astack.base_url, astack.second_url):
        eventually(lambda base=base: _chat(base, live["key"]), lambda r: r.status_code == 401,
                   f"the expired key refused at {base}")
    counted = _counters(astack, account["id"], live["id"])
    assert counted[0] == counted[1] >= 1  # the requests served before every process saw the expiry
    for base in (astack.base_url, astack.second_url):
        assert _chat(base, live["key"]).status_code == 401
    assert _counters(astack, account["id"], live["id"]) == counted  # a refused key counts nothing


def test_a_keys_daily_cap_is_exact_across_two_gateway_processes(astack, admin) -> None:
    account = admin.post("/accounts", json={"name": "capped", "plan": "pro"}).json()
    capped = admin.post(f"/accounts/{account['id']}/keys", json={"name": "batch", "daily_limit": 4}).json()
    other = admin.post(f"/accounts/{account['id']}/keys", json={"name": "web"}).json()
    bases = [astack.base_url, astack.second_url]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda n: _chat(bases[n % 2], capped["key"]), range(12)))
    assert sorted(r.status_code for r in answers) == [200] * 4 + [429] * 8
    served = [r for r in answers if r.status_code == 200]
    assert sorted(r.headers["x-ratelimit-remaining-requests-key"] for r in served) == ["0", "1", "2", "3"]
    for refused in (r for r in answers if r.status_code == 429):
        error = refused.json()["error"]
        assert error["code"] == "key_rate_limit_exceeded" and "'batch'" in error["message"]
        assert 0 < int(refused.headers["retry-after"]) <= 86400
        assert refused.headers["x-ratelimit-remaining-requests-key"] == "0"
    for answer in answers:  # the account's headers stay the account's
        assert answer.headers["x-ratelimit-limit-requests-key"] == "4"
        assert answer.headers["x-ratelimit-limit-requests"] != "4"
    assert _counters(astack, account["id"], capped["id"]) == (4, 4)  # refusals counted nothing
    uncapped = _chat(astack.base_url, other["key"])
    assert uncapped.status_code == 200  # the account's other key is not capped
    assert "x-ratelimit-limit-requests-key" not in uncapped.headers
    usage = httpx.get(f"{astack.base_url}/v1/usage", headers=_auth(other["key"])).json()["today"]
    assert usage["requests"] == 5
    by_key = {k["id"]: k for k in usage["keys"]}
    assert (by_key[capped["id"]]["requests"], by_key[capped["id"]]["limit"], by_key[capped["id"]]["remaining"]) \
        == (4, 4, 0)
    assert (by_key[other["id"]]["requests"], by_key[other["id"]]["limit"]) == (1, None)
    # Raised, the cap lets the key through again on every gateway process.
    admin.patch(f"/keys/{capped['id']}", json={"daily_limit": 6})  # one more for each process
    for base in bases:
        eventually(lambda base=base: _chat(base, capped["key"]), lambda r: r.status_code != 429,
                   f"the raised cap at {base}")
    assert _counters(astack, account["id"], capped["id"]) == (7, 6)


def test_both_clis_set_and_change_key_limits(astack, admin) -> None:
    astack.env.update({"FLATFARE_ADMIN_URL": astack.base_url, "FLATFARE_ADMIN_TOKEN": astack.admin_token})
    account = admin.post("/accounts", json={"name": "cli-limits", "plan": "pro"}).json()
    out = astack.cli("admin", "keys", "create", str(account["id"]), "--name", "remote", "--model", MODEL,
                     "--daily-limit", "3", "--expires", "2099-01-01T00:00:00Z")
    assert out.returncode == 0, out.stderr
    remote = json.loads(out.stdout)
    assert (remote["allowed_models"], remote["daily_limit"], remote["expires_at"]) == ([MODEL], 3,
                                                                                       "2099-01-01T00:00:00Z")
    out = astack.cli("admin", "keys", "update", str(remote["id"]), "--set", "daily_limit=9",
                     "--set", "allowed_models=null")
    assert out.returncode == 0, out.stderr
    assert (json.loads(out.stdout)["daily_limit"], json.loads(out.stdout)["allowed_models"]) == (9, None)
    refused = astack.cli("admin", "keys", "update", str(remote["id"]), "--set", "daily_limit=0")
    assert refused.returncode == 1 and "error 422" in refused.stderr
    # The local CLI writes the database directly.
    out = astack.cli("keys", "create", "--account", "cli-limits", "--name", "local", "--model", MODEL,
                     "--model", "smollm2-135m-instruct", "--daily-limit", "2", "--expires", "30d")
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip()
    local = next(k for k in admin.get(f"/accounts/{account['id']}/keys").json()["data"] if k["name"] == "local")
    assert (local["allowed_models"], local["daily_limit"]) == ([MODEL, "smollm2-135m-instruct"], 2)
    expires = datetime.fromisoformat(local["expires_at"])
    assert timedelta(days=29) < expires - datetime.now(UTC) <= timedelta(days=30)
    out = astack.cli("keys", "update", secret[:11], "--daily-limit", "6", "--all-models", "--no-expiry",
                     "--name", "local-2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["id"] == local["id"]
    local = next(k for k in admin.get(f"/accounts/{account['id']}/keys").json()["data"] if k["id"] == local["id"])
    assert (local["name"], local["allowed_models"], local["daily_limit"], local["expires_at"]) == \
        ("local-2", None, 6, None)
    assert astack.cli("keys", "update", secret[:11], "--daily-limit", "0").returncode != 0
    assert astack.cli("keys", "update", "ff-nosuchk").returncode == 2


def test_in_flight_caps_are_data_set_changed_cleared_and_audited(astack, admin) -> None:
    plans = {p["name"]: p["max_inflight"] for p in admin.get("/plans").json()["data"]}
    assert {name: plans[name] for name in ("free", "trial", "pro", "premium", "enterprise")} == \
        {"free": 4, "trial": 16, "pro": 16, "premium": 64, "enterprise": None}  # seeded
    created = admin.post("/plans", json={"name": "bounded", "display_name": "Bounded", "max_inflight": 8})
    assert created.status_code == 201 and created.json()["max_inflight"] == 8, created.text
    assert admin.post("/plans", json={"name": "open", "display_name": "Open"}).json()["max_inflight"] is None
    assert admin.patch("/plans/bounded", json={"max_inflight": 12}).json()["max_inflight"] == 12
    assert admin.patch("/plans/bounded", json={"max_inflight": None}).json()["max_inflight"] is None
    assert admin.post("/plans", json={"name": "zero", "display_name": "Zero", "max_inflight": 0}).status_code == 422

    account = admin.post("/accounts", json={"name": "fair", "plan": "pro", "max_inflight_override": 3})
    assert account.status_code == 201 and account.json()["max_inflight_override"] == 3, account.text
    account = account.json()
    assert admin.patch(f"/accounts/{account['id']}", json={"max_inflight_override": 5}).json()[
        "max_inflight_override"] == 5
    entries = admin.get("/audit", params={"resource_type": "account", "resource_id": str(account["id"])}).json()
    assert (entries["data"][0]["before"]["max_inflight_override"],
            entries["data"][0]["after"]["max_inflight_override"]) == (3, 5)

    key = admin.post(f"/accounts/{account['id']}/keys", json={"name": "batch", "max_inflight": 2})
    assert key.status_code == 201 and key.json()["max_inflight"] == 2, key.text
    key = key.json()
    # Above the account's cap is allowed (the lower one binds); out of range, or not a number, is not.
    assert admin.patch(f"/keys/{key['id']}", json={"max_inflight": 50}).json()["max_inflight"] == 50
    for value in (0, -1, 100_001, "many"):
        refused = admin.patch(f"/keys/{key['id']}", json={"max_inflight": value})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "max_inflight", refused.text
    assert admin.post(f"/accounts/{account['id']}/keys", json={"max_inflight": 0}).status_code == 422
    renamed = admin.patch(f"/keys/{key['id']}", json={"name": "batch-2"}).json()
    assert renamed["max_inflight"] == 50  # left out: kept
    entries = admin.get("/audit", params={"resource_type": "key", "resource_id": str(key["id"])}).json()["data"]
    assert [e["action"] for e in entries] == ["key.update", "key.update", "key.create"]
    assert (entries[1]["before"]["max_inflight"], entries[1]["after"]["max_inflight"]) == (2, 50)
    assert admin.get(f"/accounts/{account['id']}/keys").json()["data"][0]["max_inflight"] == 50
    # A rotation must not widen what the key may do.
    rotated = admin.post(f"/keys/{key['id']}/rotate", json={"grace_seconds": 60}).json()
    assert rotated["max_inflight"] == 50

    # /v1/usage shows both caps and what is in flight now, on every gateway process once its caches expired.
    cleared = admin.patch(f"/keys/{rotated['id']}", json={"max_inflight": None}).json()
    assert cleared["max_inflight"] is None
    for base in (astack.base_url, astack.second_url):
        usage = eventually(lambda base=base: httpx.get(f"{base}/v1/usage", headers=_auth(rotated["key"])).json(),
                           lambda u: u["max_inflight"] == 5, f"the account's override in /v1/usage at {base}")
        by_key = {k["id"]: k for k in usage["today"]["keys"]}
        assert usage["inflight"] == 0
        assert (by_key[key["id"]]["max_inflight"], by_key[key["id"]]["inflight"]) == (50, 0)
        assert (by_key[rotated["id"]]["max_inflight"], by_key[rotated["id"]]["inflight"]) == (None, 0)
    admin.patch(f"/accounts/{account['id']}", json={"max_inflight_override": None})
    eventually(lambda: httpx.get(f"{astack.base_url}/v1/usage", headers=_auth(rotated["key"])).json(),
               lambda u: u["max_inflight"] == 16, "the plan's cap once the override is cleared")


def test_both_clis_set_and_change_a_keys_in_flight_cap(astack, admin) -> None:
    astack.env.update({"FLATFARE_ADMIN_URL": astack.base_url, "FLATFARE_ADMIN_TOKEN": astack.admin_token})
    account = admin.post("/accounts", json={"name": "cli-inflight", "plan": "pro"}).json()
    out = astack.cli("admin", "keys", "create", str(account["id"]), "--name", "remote", "--max-inflight", "3")
    assert out.returncode == 0, out.stderr
    remote = json.loads(out.stdout)
    assert remote["max_inflight"] == 3
    out = astack.cli("admin", "keys", "update", str(remote["id"]), "--set", "max_inflight=7")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight"] == 7, out.stderr
    out = astack.cli("admin", "keys", "update", str(remote["id"]), "--set", "max_inflight=null")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight"] is None, out.stderr
    refused = astack.cli("admin", "keys", "update", str(remote["id"]), "--set", "max_inflight=0")
    assert refused.returncode == 1 and "error 422" in refused.stderr
    assert astack.cli("admin", "keys", "create", str(account["id"]), "--max-inflight", "0").returncode == 2
    out = astack.cli("admin", "accounts", "update", str(account["id"]), "--set", "max_inflight_override=9")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight_override"] == 9, out.stderr
    # The local CLI writes the database directly.
    out = astack.cli("keys", "create", "--account", "cli-inflight", "--name", "local", "--max-inflight", "2")
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip()
    local = next(k for k in admin.get(f"/accounts/{account['id']}/keys").json()["data"] if k["name"] == "local")
    assert local["max_inflight"] == 2
    out = astack.cli("keys", "update", secret[:11], "--max-inflight", "6")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight"] == 6, out.stderr
    out = astack.cli("keys", "update", str(local["id"]), "--name", "local-2")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight"] == 6, out.stderr  # not given: kept
    out = astack.cli("keys", "update", str(local["id"]), "--no-max-inflight")
    assert out.returncode == 0 and json.loads(out.stdout)["max_inflight"] is None, out.stderr
    assert astack.cli("keys", "update", str(local["id"]), "--max-inflight", "0").returncode != 0
    contradiction = astack.cli("keys", "update", str(local["id"]), "--max-inflight", "3", "--no-max-inflight")
    assert contradiction.returncode != 0 and "--max-inflight" in contradiction.stderr
    assert next(k for k in admin.get(f"/accounts/{account['id']}/keys").json()["data"]
                if k["id"] == local["id"])["max_inflight"] is None


# -- models kept on demand and LoRA variants (issue 22) ------------------------------------------------

def _refused(response: httpx.Response, status: int, param: str, *words: str) -> None:
    """An OpenAI error envelope with ``status``, naming ``param`` and saying each of ``words``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert all(word in error["message"] for word in words), error["message"]


def test_an_idle_timeout_is_set_shown_cleared_and_bounded(admin) -> None:
    created = admin.post("/models", json={"name": "on-demand-1", "source": "instant", "idle_timeout_s": 120})
    assert created.status_code == 201, created.text
    shown = created.json()
    assert (shown["idle_timeout_s"], shown["base_model"], shown["pinned"]) == (120, None, False)
    assert admin.patch("/models/on-demand-1", json={"idle_timeout_s": 600}).json()["idle_timeout_s"] == 600
    for wrong in (9, 86_401, "soon"):
        _refused(admin.patch("/models/on-demand-1", json={"idle_timeout_s": wrong}), 422, "idle_timeout_s")
    assert admin.get("/models/on-demand-1").json()["idle_timeout_s"] == 600
    # null: back to the fleet's default.
    assert admin.patch("/models/on-demand-1", json={"idle_timeout_s": None}).json()["idle_timeout_s"] is None
    audited = admin.get("/audit", params={"limit": 200}).json()["data"]
    assert any(e["action"] == "model.update" and (e["before"] or {}).get("idle_timeout_s") == 120
               and e["after"]["idle_timeout_s"] == 600 for e in audited)


def test_a_variants_base_must_exist_be_enabled_be_no_variant_and_serve_adapters(admin) -> None:
    lora = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2, "tool_call_parser": "hermes"}
    base = admin.post("/models", json={"name": "lora-base", "source": "instant", "engine_options": lora})
    assert base.status_code == 201, base.text
    assert admin.post("/models", json={"name": "plain-base", "source": "instant"}).status_code == 201
    assert admin.post("/models", json={"name": "off-base", "source": "instant", "engine_options": lora,
                                       "enabled": False}).status_code == 201
    variant = admin.post("/models", json={"name": "lora-v1", "source": "/adapters/v1", "base_model": "lora-base"})
    assert variant.status_code == 201, variant.text
    shown = admin.get("/models/lora-v1").json()
    # It offers what its base's engines do (its own engine options are not used).
    assert (shown["base_model"], shown["engine_options"], shown["capabilities"]["tools"]) == ("lora-base", {}, True)
    for name, base, words in (("v-missing", "no-such-base", ("no-such-base", "not in the catalog")),
                              ("v-chain", "lora-v1", ("lora-v1", "itself a variant of 'lora-base'")),
                              ("v-plain", "plain-base", ("plain-base", "enable_lora")),
                              ("v-off", "off-base", ("off-base", "disabled")),
                              ("v-self", "v-self", ("its own base_model",))):
        _refused(admin.post("/models", json={"name": name, "source": "/adapters/x", "base_model": base}),
                 400, "base_model", *words)
        assert admin.get(f"/models/{name}").status_code == 404  # nothing created
    # A variant runs on its base's engines: it keeps nothing up of its own.
    _refused(admin.post("/models", json={"name": "v-pinned", "source": "/a", "base_model": "lora-base",
                                         "pinned": True}), 400, "pinned", "lora-base")
    _refused(admin.patch("/models/lora-v1", json={"idle_timeout_s": 60}), 400, "idle_timeout_s", "lora-base")
    _refused(admin.patch("/models/lora-v1", json={"base_model": "plain-base"}), 400, "base_model", "enable_lora")
    assert admin.get("/models/lora-v1").json()["base_model"] == "lora-base"
    # A base with a variant can make itself no variant, and cannot lose its adapters, be disabled or deleted.
    _refused(admin.patch("/models/lora-base", json={"base_model": "off-base"}), 400, "base_model", "lora-v1")
    _refused(admin.patch("/models/lora-base", json={"engine_options": {}}), 409, "engine_options.enable_lora",
             "lora-v1")
    _refused(admin.patch("/models/lora-base", json={"enabled": False}), 409, "enabled", "lora-v1")
    assert admin.get("/models/lora-base").json()["enabled"] is True
    refused = admin.delete("/models/lora-base")
    assert refused.status_code == 409 and "lora-v1" in refused.json()["error"]["message"]
    # LoRA options are checked like every engine option.
    _refused(admin.patch("/models/plain-base", json={"engine_options": {"max_loras": 2}}), 422,
             "engine_options", "enable_lora")
    _refused(admin.patch("/models/plain-base", json={"engine_options": {"enable_lora": True, "max_lora_rank": 12}}),
             422, "engine_options.max_lora_rank")
    assert admin.delete("/models/lora-v1").status_code == 204
    assert admin.patch("/models/lora-base", json={"enabled": False}).status_code == 200
    assert admin.delete("/models/lora-base").status_code == 204


def test_the_cli_adds_models_on_demand_and_variants(astack, admin) -> None:
    astack.env.update({"FLATFARE_ADMIN_URL": astack.base_url, "FLATFARE_ADMIN_TOKEN": astack.admin_token})
    out = astack.cli("admin", "models", "add", "cli-base", "--source", "instant", "--option", "enable_lora=true",
                     "--option", "max_lora_rank=8", "--idle-timeout-s", "300")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["idle_timeout_s"], shown["engine_options"]["enable_lora"]) == (300, True)
    out = astack.cli("admin", "models", "add", "cli-variant", "--source", "/adapters/a", "--base-model", "cli-base")
    assert out.returncode == 0 and json.loads(out.stdout)["base_model"] == "cli-base", out.stderr
    out = astack.cli("admin", "models", "add", "cli-orphan", "--source", "/adapters/b", "--base-model", "nope")
    assert out.returncode == 1 and "error 400" in out.stderr and "nope" in out.stderr
    out = astack.cli("admin", "models", "update", "cli-base", "--pinned")
    assert out.returncode == 0 and json.loads(out.stdout)["pinned"] is True, out.stderr
    out = astack.cli("admin", "models", "update", "cli-base", "--on-demand", "--idle-timeout-s", "900")
    assert out.returncode == 0, out.stderr
    assert (json.loads(out.stdout)["pinned"], json.loads(out.stdout)["idle_timeout_s"]) == (False, 900)
    both = astack.cli("admin", "models", "update", "cli-base", "--idle-timeout-s", "60", "--default-idle-timeout")
    assert both.returncode == 2 and "not both" in both.stderr
    out = astack.cli("admin", "models", "update", "cli-base", "--default-idle-timeout")
    assert out.returncode == 0 and json.loads(out.stdout)["idle_timeout_s"] is None, out.stderr
    assert admin.get("/models/cli-orphan").status_code == 404
