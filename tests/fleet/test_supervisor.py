"""`flatfare fleet` as a process against the real gateway, Redis and SQLite, its workers on the instant
engine (a start delay, and sleep and wake like vLLM's sleep mode): a request brings its model up, an
idle engine goes away, a budget of one engine serves three models in turn without ever holding two
and without losing a request, a (pretend) GPU host puts engines to sleep and wakes them instead of
starting them again, and a start that keeps failing is retried with backoff and says why."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.contract import FleetStatus
from tests.conftest import Stack, eventually, launch_stack, stop_process

MODELS = ("m1", "m2", "m3")
FLEET = "t"
# A cold request waits this long for its model (the gateway's FLATFARE_COLD_START_TIMEOUT_S): rotating
# three models through one engine makes a request wait for two others' turns on a slow machine.
COLD_START_TIMEOUT_S = 300
UP_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway on an instant-engine stack, with the catalog models the fleets serve."""
    with launch_stack(tmp_path_factory.mktemp("fleet"), model="instant", worker_args=("--engine", "instant"),
                      env={"FLATFARE_COLD_START_TIMEOUT_S": str(COLD_START_TIMEOUT_S)}) as s:
        for name in MODELS:
            s.sql("INSERT INTO models (name, source, engine_options, enabled, pinned, min_workers) "
                  "VALUES (:name, 'instant', '{}', true, false, 0)", name=name)
        yield s


@contextmanager
def fleet(stack: Stack, *args: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`flatfare fleet` on the stack, its workers instant engines that take a second to start; stopped
    (its workers with it) on exit, and then no worker of it is left."""
    log = (stack.logs / "fleet.log").open("ab")
    full_env = {**stack.env, "FLATFARE_FLEET_ID": FLEET, "FLATFARE_ENGINE": "instant",
                "FLATFARE_INSTANT_START_DELAY_S": "1", "FLATFARE_FLEET_METRICS_PORT": "-1", **env}
    proc = subprocess.Popen([sys.executable, "-m", "flatfare", "fleet", *args], env=full_env,
                            cwd=stack.logs.parent, stdout=log, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: status(stack), lambda s: s is not None, "the fleet's first status", timeout_s=60)
        yield proc
    finally:
        stop_process(proc)
        log.close()
        assert proc.returncode == 0, (stack.logs / "fleet.log").read_text()[-3000:]
        assert pool_members(stack) == set(), "a worker of the fleet outlived it"


def status(stack: Stack) -> FleetStatus | None:
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        raw = client.get(contract.fleet_key(FLEET))
        return FleetStatus.decode(raw) if raw else None
    finally:
        client.close()


def pool_members(stack: Stack) -> set[str]:
    """Every worker in the models' pools, read in one transaction (so one snapshot)."""
    client = redis_sync.Redis.from_url(stack.redis_url)
    try:
        pipe = client.pipeline(transaction=True)
        for name in MODELS:
            pipe.zrange(contract.pool_key(name), 0, -1)
        return {w.decode() for members in pipe.execute() for w in members}
    finally:
        client.close()


def workers_of(fleet_process: subprocess.Popen[bytes]) -> set[int]:
    """The fleet's worker processes still alive (a stopped one counts until it has exited)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == fleet_process.pid and fields[0] != "Z":
            children.add(int(stat.parent.name))
    return children


def ask(stack: Stack, model: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {stack.api_key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      timeout=COLD_START_TIMEOUT_S + 60)


def decisions(stack: Stack, action: str, model: str) -> list[dict]:
    fleet_status = status(stack)
    return [d for d in (fleet_status.decisions if fleet_status else []) if d["action"].startswith(action)
            and d["model"] == model]


def set_idle_timeout(stack: Stack, seconds: int | None) -> None:
    stack.sql("UPDATE models SET idle_timeout_s = :s WHERE name IN ('m1', 'm2', 'm3')", s=seconds)


def test_a_request_brings_its_model_up_and_the_idle_engine_stops(stack: Stack) -> None:
    set_idle_timeout(stack, 3)
    with fleet(stack, "--model", "m1", "--max-awake", "1", "--gpus", "cpu"):
        first = status(stack)
        assert first is not None and first.models == ["m1"] and first.engines == {}
        assert (first.accelerator, first.max_awake) == ("cpu", 1)
        answer = ask(stack, "m1")
        assert answer.status_code == 200, answer.text
        assert int(answer.headers["x-flatfare-model-wait-ms"]) > 0
        assert decisions(stack, "start", "m1")[0]["why"].startswith("1 request(s) queued")
        eventually(lambda: status(stack), lambda s: s.engines == {} and decisions(stack, "stop", "m1"),
                   "the idle engine stopped", timeout_s=UP_WITHIN_S)
        assert "idle for" in decisions(stack, "stop", "m1")[0]["why"]
        assert pool_members(stack) == set()


def test_one_engine_serves_three_models_in_turn_never_two_at_once_and_loses_nothing(stack: Stack) -> None:
    set_idle_timeout(stack, None)
    seen: list[set[str]] = []
    processes: list[set[int]] = []
    done = threading.Event()

    def watch(fleet_process: subprocess.Popen[bytes]) -> None:
        while not done.is_set():
            seen.append(pool_members(stack))
            processes.append(workers_of(fleet_process))
            time.sleep(0.01)

    answers: dict[str, list[int]] = {}

    def client(name: str, order: tuple[str, ...]) -> None:
        answers[name] = [ask(stack, model).status_code for model in order]

    with fleet(stack, "--model", "m1", "--model", "m2", "--model", "m3", "--max-awake", "1",
               "--gpus", "cpu") as fleet_process:
        watcher = threading.Thread(target=watch, args=(fleet_process,))
        watcher.start()
        clients = [threading.Thread(target=client, args=(f"c{i}", MODELS[i:] + MODELS[:i])) for i in range(3)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        done.set()
        watcher.join()
        assert answers == {f"c{i}": [200, 200, 200] for i in range(3)}
        assert max(len(s) for s in seen) == 1, [s for s in seen if len(s) > 1][:3]
        # Nor two worker processes: the next starts only once the last one has exited.
        assert max(len(p) for p in processes) == 1, [p for p in processes if len(p) > 1][:3]
        # Each model was served, and engines made room for each other: stopped as least recently used.
        assert {m for s in seen for w in s for m in MODELS if f"-{m}-" in w} == set(MODELS)
        assert any("least recently used" in d["why"] for m in MODELS for d in decisions(stack, "stop", m))


def test_on_a_gpu_host_idle_engines_sleep_and_are_woken_not_started_again(stack: Stack) -> None:
    set_idle_timeout(stack, None)
    # Instant engines sleep and wake like vLLM's sleep mode; GPU 0 is only a name to them.
    with fleet(stack, "--model", "m1", "--model", "m2", "--max-awake", "1", "--gpus", "0",
               FLATFARE_INSTANT_SLEEP_DELAY_S="0.5", FLATFARE_INSTANT_WAKE_DELAY_S="0.5"):
        assert ask(stack, "m1").status_code == 200
        assert ask(stack, "m2").status_code == 200
        [m1] = [w for w, e in status(stack).engines.items() if e["model"] == "m1"]
        # Its heartbeat names the fleet that started it: only that fleet commands it.
        heartbeat = redis_sync.Redis.from_url(stack.redis_url).hgetall(contract.worker_key(m1))
        assert contract.WorkerInfo.from_fields(heartbeat).fleet == FLEET
        slept = eventually(lambda: status(stack), lambda s: s.engines[m1]["state"] == "asleep", "m1 asleep")
        assert slept.tick_s == 0.1  # a GPU host decides every 0.1 s: a wake waits out two ticks
        assert slept.engines[m1]["sleep_level"] == 1 and slept.engines[m1]["slots"] == ["0"]
        answer = ask(stack, "m1")
        assert answer.status_code == 200, answer.text
        # The same engine, woken (the status is a second behind): not a second start.
        eventually(lambda: status(stack), lambda s: s.engines.get(m1, {}).get("state") == "warm", "m1 warm again")
        assert len(decisions(stack, "start", "m1")) == 1
        assert decisions(stack, "wake", "m1") and decisions(stack, "sleep (level 1)", "m2")
        # The wake's time is the model's fact, so the gateway can say how long the next one takes.
        facts = redis_sync.Redis.from_url(stack.redis_url).hgetall(contract.model_facts_key("m1"))
        assert contract.ModelFacts.from_fields(facts).wake_s > 0


def test_a_failing_start_is_retried_with_backoff_and_says_why(stack: Stack) -> None:
    # A setting every worker refuses: each start fails at once, as a broken model or driver would.
    with fleet(stack, "--model", "m3", "--gpus", "cpu", FLATFARE_INSTANT_TOKENS="many") as _:
        stack.sql("UPDATE models SET pinned = true WHERE name = 'm3'")
        try:
            failed = eventually(lambda: status(stack), lambda s: "m3" in s.waiting
                                and s.waiting["m3"].startswith("the start failed (2 time(s)): "), "the failure said",
                                timeout_s=UP_WITHIN_S)
            # The worker's own words: the exception it died of, not its traceback's last line.
            assert "validation error for WorkerSettings" in failed.waiting["m3"], failed.waiting
            starts = [d["t"] for d in failed.decisions if d["action"] == "start"]
            assert len(starts) >= 2 and starts[1] - starts[0] >= 5000  # the first retry waits BACKOFF_S
        finally:
            stack.sql("UPDATE models SET pinned = false WHERE name = 'm3'")


def test_fleet_status_and_the_admin_api_show_the_engines_and_decisions(stack: Stack) -> None:
    token = stack.cli("admin", "bootstrap", "--name", "fleet-test")
    assert token.returncode == 0, token.stderr
    admin = {"Authorization": f"Bearer {token.stdout.strip()}"}
    with fleet(stack, "--model", "m2", "--preload", "m2", "--gpus", "cpu"):
        eventually(lambda: status(stack), lambda s: any(e["state"] == "warm" for e in s.engines.values()),
                   "the preloaded model warm", timeout_s=UP_WITHIN_S)
        shown = stack.cli("fleet", "status")
        assert shown.returncode == 0, shown.stderr
        assert f"fleet {FLEET} on" in shown.stdout and "cpu slots cpu" in shown.stdout
        assert "a decision every 0.5 s" in shown.stdout  # a CPU host's default tick
        assert "m2" in shown.stdout and "warm" in shown.stdout and "start m2" in shown.stdout
        page = httpx.get(f"{stack.base_url}/admin/v1/fleets", headers=admin, timeout=10)
        assert page.status_code == 200, page.text
        [listed] = page.json()["data"]
        assert (listed["fleet_id"], listed["models"], listed["accelerator"]) == (FLEET, ["m2"], "cpu")
        assert [e["state"] for e in listed["engines"].values()] == ["warm"]
        assert listed["decisions"][0]["action"] == "start" and listed["decisions"][0]["model"] == "m2"
        assert httpx.get(f"{stack.base_url}/admin/v1/fleets", timeout=10).status_code == 401
        # The model's admin state names the fleets that can start it (m1 is not among this one's).
        def fleets_of(model: str) -> list[dict]:
            return httpx.get(f"{stack.base_url}/admin/v1/models/{model}", headers=admin, timeout=10).json()["fleets"]

        [serving] = eventually(lambda: fleets_of("m2"), lambda f: len(f) == 1, "m2's fleets")
        assert (serving["fleet_id"], serving["waiting"]) == (FLEET, None)
        assert fleets_of("m1") == []
    assert "no fleet is running" in stack.cli("fleet", "status").stdout
    assert httpx.get(f"{stack.base_url}/admin/v1/fleets", headers=admin, timeout=10).json()["data"] == []


def test_one_fleet_per_id_and_a_dead_fleets_workers_are_stopped_by_its_successor(stack: Stack) -> None:
    with fleet(stack, "--model", "m2", "--preload", "m2", "--gpus", "cpu") as first:
        second = subprocess.run([sys.executable, "-m", "flatfare", "fleet", "--model", "m2"], capture_output=True,
                                text=True, timeout=60, env={**stack.env, "FLATFARE_FLEET_ID": FLEET}, check=False)
        assert second.returncode == 2 and f"fleet '{FLEET}' is running already" in second.stderr, second.stderr
        eventually(lambda: status(stack), lambda s: any(e["state"] == "warm" for e in s.engines.values()),
                   "m2 warm", timeout_s=UP_WITHIN_S)
        [orphan] = pool_members(stack)
        # The fleet dies without stopping its worker, which lives on in a session of its own.
        first.kill()
        first.wait()
        eventually(lambda: status(stack), lambda s: s is None, "the dead fleet's status expired", timeout_s=30)
        assert pool_members(stack) == {orphan}
        first.returncode = 0  # for the context manager: this fleet is dealt with
        with fleet(stack, "--model", "m2", "--gpus", "cpu"):
            eventually(lambda: pool_members(stack), lambda members: not members, "the orphan stopped",
                       timeout_s=UP_WITHIN_S)
            [told] = decisions(stack, "stop", "m2")
            assert told["worker_id"] == orphan and "earlier run of this fleet" in told["why"]
