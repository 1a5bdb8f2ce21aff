"""Scaling a worker pool from zero on Kubernetes, proven without a cluster: requests for an on-demand
model with no worker are admitted through the real admission script (gateway/jobpath/queueing.py) into an
account's queue and into a dead worker's own stream on a live Redis, the gateway's /metrics is scraped
(create_app in this process), and promtool evaluates the on-demand ScaledObject's own query over the
scraped samples, as Prometheus would for KEDA. KEDA's activation rule (the value above the trigger's
activationThreshold) then says whether the pool leaves zero."""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from flatfare import contract
from flatfare.billing.plans import quota_window
from flatfare.billing.quota import EPOCH_KEY, expiry
from flatfare.contract import Endpoint, Job, Lane
from flatfare.gateway.app import create_app
from flatfare.gateway.metrics import MULTIPROC_ENV
from flatfare.gateway.jobpath.queueing import Admitted, LaneLimits, LaneQueue, QuotaClaim
from flatfare.gateway.settings import GatewaySettings
from flatfare.storage.db import create_engine, migrate, session_factory
from flatfare.storage.models import CatalogModel
from tests.conftest import need
from tests.deploy.files import k8s_documents
from tests.deploy.test_observability import PROMTOOL, PROMTOOL_MISSING
from tests.gateway.test_asgi import lifespan

# Two gateway replicas scraped: each reports the same platform-wide numbers.
REPLICAS = ("gateway-a:8000", "gateway-b:8000")


def on_demand_trigger() -> tuple[str, dict[str, str]]:
    """The model of the pool deploy/k8s keeps on demand (minReplicaCount 0), and its trigger's metadata."""
    deployments = {d["metadata"]["name"]: d for _, d in k8s_documents() if d["kind"] == "Deployment"}
    found = []
    for _, obj in k8s_documents():
        if obj["kind"] == "ScaledObject" and obj["spec"]["minReplicaCount"] == 0:
            (container,) = deployments[obj["spec"]["scaleTargetRef"]["name"]]["spec"]["template"]["spec"]["containers"]
            model = next(e["value"] for e in container["env"] if e["name"] == "FLATFARE_MODEL")
            (trigger,) = obj["spec"]["triggers"]
            found.append((model, trigger["metadata"]))
    assert found, "deploy/k8s has no pool scaled from zero"
    return found[0]


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app on the live Redis and a migrated SQLite file (its seeded catalog), no worker."""
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    database = f"sqlite:///{tmp_path / 'gateway.db'}"
    migrate(database)
    settings = GatewaySettings(redis_url=redis_url, database_url=database, data_dir=tmp_path, external_scaler=True,
                               log_format="text", log_level="warning")
    app = create_app(settings)
    async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                base_url="http://gateway") as client:
        client.database = database  # type: ignore[attr-defined]
        yield client


def series_of(exposition: str) -> list[dict[str, str]]:
    """promtool's input series for every sample of a scrape, as each replica's target would store it."""
    series = []
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            for instance in REPLICAS:
                labels = {**sample.labels, "instance": instance, "job": "flatfare-gateway"}
                text = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
                series.append({"series": f"{sample.name}{{{text}}}", "values": f"{float(sample.value)!r}x10"})
    return series


def promtool_expects(tmp_path: Path, exposition: str, tests: list[dict[str, Any]]) -> None:
    """Run ``promtool test rules`` over the scrape: each of ``tests`` is {expr, exp_samples}."""
    unit = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series_of(exposition),
        "promql_expr_test": [{"eval_time": "5m", **t} for t in tests]}]}
    path = tmp_path / f"scrape-{time.monotonic_ns()}.test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def keda_sees(tmp_path: Path, exposition: str, metadata: dict[str, str], queued: int) -> None:
    """The trigger's query evaluates to ``queued`` over the scrape, and KEDA's activation (value >
    activationThreshold, evaluated by promtool too) holds exactly when something is queued."""
    query, threshold = metadata["query"], float(metadata["activationThreshold"])
    active = queued > threshold
    promtool_expects(tmp_path, exposition, [
        {"expr": query, "exp_samples": [{"labels": "{}", "value": queued}]},
        {"expr": f"({query}) > {metadata['activationThreshold']}",
         "exp_samples": [{"labels": "{}", "value": queued}] if active else []}])
    assert active == (queued >= 1)
    assert math.ceil(queued / float(metadata["threshold"])) == (1 if queued else 0)  # the workers it asks for


async def admit(queue: LaneQueue, model: str, request_id: str, stream: str | None = None) -> Admitted:
    window = quota_window("UTC", datetime.now(UTC))
    job = Job(request_id=request_id, endpoint=Endpoint.CHAT, body="{}", enqueued_ms=int(time.time() * 1000),
              lane=Lane.STANDARD, account_id=1)
    return await queue.admit(job, model, QuotaClaim(1, window.day, None, expiry(window.resets_at)), stream)


async def test_one_queued_request_activates_a_pool_with_no_worker(gateway, redis, tmp_path: Path) -> None:
    need(PROMTOOL, PROMTOOL_MISSING)
    model, metadata = on_demand_trigger()
    engine = create_engine(gateway.database)
    try:
        async with session_factory(engine)() as session:
            entry = await session.get(CatalogModel, model)
            # A seeded catalog model kept on demand; and a LoRA variant of it, which has no pool of its own.
            assert entry is not None and entry.enabled and not entry.pinned and entry.min_workers == 0
            session.add(CatalogModel(name=f"{model}-variant", source="/adapters/v", engine_options={},
                                     base_model=model))
            await session.commit()
            assert (await session.scalar(select(CatalogModel.base_model).where(
                CatalogModel.name == f"{model}-variant"))) == model
    finally:
        await engine.dispose()
    assert not await redis.zrange(contract.pool_key(model), 0, -1)  # no worker, live or dead

    async def scrape() -> str:
        response = await gateway.get("/metrics")
        assert response.status_code == 200
        return response.text

    nothing = await scrape()
    assert f'flatfare_model_demand{{model="{model}"}} 0.0' in nothing
    assert f'model="{model}-variant"' not in nothing
    keda_sees(tmp_path, nothing, metadata, 0)

    await redis.set(EPOCH_KEY, 1, nx=True)  # the quota counters are trusted (a gateway rebuilds them otherwise)
    queue = LaneQueue(redis, {lane: LaneLimits(100, 60.0) for lane in Lane})
    fair = await admit(queue, model, "r-queued")
    keda_sees(tmp_path, await scrape(), metadata, 1)

    # A worker that took prefix-routed jobs and died: its heartbeat is stale, its own stream still holds
    # a job routed to it (read by nobody) and nothing else serves the model.
    dead = "worker-gone"
    await redis.zadd(contract.pool_key(model), {dead: int(time.time() * 1000) - 3_600_000})
    own = contract.worker_stream(model, dead)
    await redis.xgroup_create(own, contract.POOL_GROUP, id="0", mkstream=True)
    routed = await admit(queue, model, "r-routed", stream=own)
    keda_sees(tmp_path, await scrape(), metadata, 2)

    # Both withdrawn (their clients' deadlines passed): nothing asks for a worker any more.
    assert await queue.withdraw(fair.queued) and await queue.withdraw(routed.queued)
    keda_sees(tmp_path, await scrape(), metadata, 0)
