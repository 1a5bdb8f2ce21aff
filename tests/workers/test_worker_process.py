"""`flatfare worker --fleet F` as its fleet supervisor runs it (instant engine, real redis-server): while
it starts it heartbeats ``starting`` with the phase it is in; warm, it names its fleet, records the
model's start time and context length, and a STOP command makes it drain and exit 0. A worker asked to
serve a LoRA variant as a model of its own refuses, naming the base whose workers serve it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.contract import Command, CommandKind, ModelFacts, WorkerInfo, WorkerState
from flatfare.storage.models import CatalogModel
from flatfare.workers.main import WorkerError, load_spec
from flatfare.workers.settings import WorkerSettings
from tests.conftest import eventually

MODEL = "fleet-instant"


def _info(client: redis_sync.Redis, worker_id: str) -> WorkerInfo | None:
    fields = client.hgetall(contract.worker_key(worker_id))
    return WorkerInfo.from_fields(fields) if fields else None


def test_a_fleet_worker_says_its_phase_records_its_start_and_exits_0_on_stop(redis_url: str, tmp_path) -> None:
    client = redis_sync.Redis.from_url(redis_url)
    # The model's last start, as a previous worker recorded it: shown while this one starts.
    client.hset(contract.model_facts_key(MODEL), mapping=ModelFacts(start_s=42.0).to_fields())
    env = {**os.environ, "FLATFARE_REDIS_URL": redis_url, "FLATFARE_WORKER_ID": "fw1", "FLATFARE_METRICS_PORT": "-1",
           "FLATFARE_INSTANT_START_DELAY_S": "3", "FLATFARE_DATA_DIR": str(tmp_path)}
    worker = subprocess.Popen([sys.executable, "-m", "flatfare", "worker", "--engine", "instant", "--model", MODEL,
                               "--fleet", "fleet-a"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        starting = eventually(lambda: _info(client, "fw1"), lambda i: i is not None and "phase" in i.extra,
                              "a starting heartbeat with its phase", timeout_s=60)
        assert starting.state is WorkerState.STARTING and starting.fleet == "fleet-a"
        assert starting.extra["phase"] == "starting the engine" and starting.extra["phase_since_ms"] > 0
        assert starting.extra["expected_start_s"] == 42.0
        warm = eventually(lambda: _info(client, "fw1"), lambda i: i is not None and i.state is WorkerState.WARM,
                          "the worker warm", timeout_s=60)
        assert warm.fleet == "fleet-a" and "phase" not in warm.extra
        assert warm.extra["sleep_mode"] is True  # the instant engine sleeps as a GPU engine does
        facts = ModelFacts.from_fields(client.hgetall(contract.model_facts_key(MODEL)))
        # Measured from the process's start, so the start delay is in it; the old 42 s is replaced.
        assert 3.0 <= facts.start_s < 42.0 and facts.max_model_len == warm.max_model_len
        stop = Command(CommandKind.STOP, issued_ms=int(time.time() * 1000))
        client.rpush(contract.worker_commands("fw1"), stop.encode())
        assert worker.wait(timeout=60) == 0
        assert _info(client, "fw1") is None
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        client.close()


async def test_a_worker_refuses_to_serve_a_lora_variant_as_a_model(database_url: str, sessions) -> None:
    async with sessions() as session, session.begin():
        session.add(CatalogModel(name="smol-support", source="/adapters/support", engine_options={},
                                 base_model="smollm2-135m-instruct"))
    with pytest.raises(WorkerError, match="LoRA variant of 'smollm2-135m-instruct'"):
        await load_spec(WorkerSettings(model="smol-support", database_url=database_url, redis_url="redis://unused"))
