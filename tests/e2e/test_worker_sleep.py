"""A fleet's worker on the real vLLM CPU engine: started with FLATFARE_SLEEP_MODE=1 it still starts
(vLLM's CPU build has no sleep mode, so the engine starts without it; without the setting the refusal
says the same: the CPU, not the setting, is why), says while starting what the
engine is doing (phases read from vLLM's own log records, written by its engine processes), records the
model's start time and context length once warm, refuses SLEEP (stays warm, says why in its heartbeat,
keeps serving) and exits 0 on STOP: what a fleet does with an idle CPU engine."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from flatfare import contract
from flatfare.contract import Command, CommandKind, ModelFacts, ReplyKind, WorkerState
from flatfare.workers.phases import PREPARING, STARTING_ENGINE
from tests.conftest import eventually
from tests.e2e.real_worker import MODEL, RealWorker, real_worker

pytestmark = pytest.mark.e2e

VLLM_PHASES = {"loading weights", "compiling for the CPU", "compiling the model", "capturing graphs", "warming up"}


@pytest.fixture(scope="module")
def cpu_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealWorker]:
    """Asked for sleep mode, as a fleet on a GPU host would. Not asking takes the same branch on the CPU
    (Engine.start: the platform has none, whatever was asked), so one engine start covers both; it was
    a second parametrized start, ~40 s of every CI run for no branch of its own."""
    with real_worker(tmp_path_factory.mktemp("sleep"), engine_options={"enforce_eager": True},
                     env={"FLATFARE_SLEEP_MODE": "1"}, args=("--fleet", "fleet-cpu")) as worker:
        yield worker


def _command(worker: RealWorker, kind: CommandKind) -> None:
    worker.redis.rpush(contract.worker_commands(worker.worker_id),
                       Command(kind, issued_ms=int(time.time() * 1000)).encode())


def test_the_start_says_its_phases_and_is_recorded(cpu_worker: RealWorker) -> None:
    phases = {info.extra.get("phase") for info in cpu_worker.seen_starting} - {None}
    assert phases <= {PREPARING, STARTING_ENGINE, *VLLM_PHASES}, phases
    assert phases & VLLM_PHASES, f"no phase from vLLM's log was seen: {phases}"
    assert all(info.fleet == "fleet-cpu" for info in cpu_worker.seen_starting)
    info = cpu_worker.info()
    assert info is not None and info.fleet == "fleet-cpu" and "phase" not in info.extra
    facts = ModelFacts.from_fields(cpu_worker.redis.hgetall(contract.model_facts_key(MODEL)))
    assert facts.start_s > 0 and facts.max_model_len == info.max_model_len > 0


def test_sleep_is_refused_on_the_cpu_and_the_worker_keeps_serving(cpu_worker: RealWorker) -> None:
    info = cpu_worker.info()
    assert info is not None and info.extra["sleep_mode"] is False
    assert "no sleep mode" in info.extra["sleep_unavailable"]
    _command(cpu_worker, CommandKind.SLEEP)
    refused = eventually(cpu_worker.info, lambda i: i is not None and "sleep_refused" in i.extra, "the refusal",
                         timeout_s=30)
    assert refused.state is WorkerState.WARM and "no sleep mode" in refused.extra["sleep_refused"]
    assert "refusing to sleep" in cpu_worker.log.read_text()
    reply = cpu_worker.ask({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert (reply.kind, reply.status) == (ReplyKind.RESPONSE, 200)


def test_stop_makes_the_worker_exit_0(cpu_worker: RealWorker) -> None:
    _command(cpu_worker, CommandKind.STOP)
    assert cpu_worker.process.wait(timeout=120) == 0
    assert cpu_worker.info() is None
