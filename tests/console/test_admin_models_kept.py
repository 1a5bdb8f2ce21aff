"""The admin console's model page says how each model is kept (pinned, on demand with its idle
timeout, a variant of its base) and its pool's state, and edits the idle timeout through the admin
API's services (validated, audited), on a running gateway (instant engine, SQLite)."""

from __future__ import annotations

import re
import time

import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.contract import WorkerInfo, WorkerState
from tests.conftest import eventually
from tests.console.test_admin_pages import _admin_stack, admin_login

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def astack(tmp_path_factory):
    yield from _admin_stack(tmp_path_factory.mktemp("console-models-kept"), None)


def _rows(client) -> dict[str, str]:
    """Each model's row of the models table (its HTML), by name."""
    page = client.get("/console/admin/models", headers={"HX-Request": "true", "HX-Target": "model-rows"})
    assert page.status_code == 200
    return {m[1]: m[0] for m in re.finditer(r"<tr[^>]*>\s*<td><strong>([^<]+)</strong>.*?</tr>", page.text, re.S)}


def test_the_models_page_shows_and_edits_how_each_model_is_kept(astack) -> None:
    api = astack.api
    lora = {"enable_lora": True, "max_lora_rank": 8}
    for body in ({"name": "od", "source": "instant", "idle_timeout_s": 120},
                 {"name": "pin", "source": "instant", "pinned": True},
                 {"name": "lb", "source": "instant", "engine_options": lora},
                 {"name": "lv", "source": "/adapters/lv", "base_model": "lb"}):
        assert api.post("/models", json=body).status_code == 201
    # A worker of lb's pool asleep, as its heartbeat says (its fleet put it to sleep).
    client_redis = redis_sync.Redis.from_url(astack.redis_url)
    asleep = WorkerInfo(worker_id="lb-1", model="lb", pool="lb", max_model_len=2048, capacity=8,
                        started_ms=int(time.time() * 1000), state=WorkerState.ASLEEP)
    client, csrf = admin_login(astack.base_url, astack.admin_token)
    try:
        client_redis.hset(contract.worker_key("lb-1"), mapping=asleep.to_fields())
        client_redis.zadd(contract.pool_key("lb"), {"lb-1": int(time.time() * 1000) + 600_000})
        rows = eventually(lambda: _rows(client), lambda r: ">asleep<" in r.get("lv", ""), "lb's sleeping worker shown")
        assert "on demand" in rows["od"] and 'name="idle_timeout_s"' in rows["od"] and 'value="120"' in rows["od"]
        assert ">cold<" in rows["od"]  # on demand, no worker: started when asked for
        assert "pinned" in rows["pin"] and ">unavailable<" in rows["pin"] and "idle_timeout_s" not in rows["pin"]
        assert "variant of <strong>lb</strong>" in rows["lv"] and "kept up by lb" in rows["lv"]
        assert ">asleep<" in rows["lb"] and "on demand" in rows["lb"]

        def save(value: str):
            return client.post("/console/admin/models/od", headers={"HX-Request": "true", "X-CSRF-Token": csrf},
                               data={"idle_timeout_s": value})

        assert 'value="300"' in save("300").text and api.get("/models/od").json()["idle_timeout_s"] == 300
        refused = save("5")
        assert refused.status_code == 200 and "greater than or equal to 10" in refused.text
        assert api.get("/models/od").json()["idle_timeout_s"] == 300
        assert save("").status_code == 200 and api.get("/models/od").json()["idle_timeout_s"] is None  # the default
        audit = api.get("/audit", params={"limit": 50, "action": "model.update"}).json()["data"]
        assert [e["after"]["idle_timeout_s"] for e in audit if e["resource_id"] == "od"][:2] == [None, 300]
    finally:
        client.close()
        client_redis.delete(contract.worker_key("lb-1"), contract.pool_key("lb"))
        client_redis.close()
