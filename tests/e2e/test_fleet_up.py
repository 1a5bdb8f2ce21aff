"""Issue 22's "done when": `flatfare up` with two on-demand models answers requests for both, on the real
vLLM CPU engine, one engine at a time (``--on-demand --max-awake 1``): the default model starts at once
and answers; a request for the second stops the first (least recently used, idle) and starts the
second, which answers too, saying how long it waited for its model. Two engine starts in all (eager
mode, the way the shared stack starts its engine), on a Redis of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from flatfare import contract
from flatfare.contract import FleetStatus
from flatfare.redis_local import LocalRedis, free_port
from tests.conftest import MODELS_DIR, STACK_READY_TIMEOUT_S, eventually

pytestmark = pytest.mark.e2e

DEFAULT = "smollm2-135m-instruct"
SECOND = "gemma3-270m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The second model's cold request waits for a stop, maybe its preparation (once) and an engine start.
COLD_WITHIN_S = 900


class Up:
    def __init__(self, process: subprocess.Popen[bytes], output: Path, redis_url: str, base_url: str) -> None:
        self.process = process
        self.output = output
        self.redis_url = redis_url
        self.base_url = base_url
        self.key = ""

    def printed(self) -> str:
        return self.output.read_text(errors="replace")

    def fleet(self) -> FleetStatus | None:
        client = redis_sync.Redis.from_url(self.redis_url)
        try:
            raw = client.get(contract.fleet_key("local"))
            return FleetStatus.decode(raw) if raw else None
        finally:
            client.close()

    def engines(self) -> set[str]:
        """Workers in either model's pool, read in one transaction (one snapshot)."""
        client = redis_sync.Redis.from_url(self.redis_url)
        try:
            pipe = client.pipeline(transaction=True)
            for model in (DEFAULT, SECOND):
                pipe.zrange(contract.pool_key(model), 0, -1)
            return {w.decode() for members in pipe.execute() for w in members}
        finally:
            client.close()

    def worker_processes(self) -> set[int]:
        """`flatfare worker` processes under this `flatfare up` (a stopped one counts until it has exited)."""
        parents: dict[int, int] = {}
        workers: set[int] = set()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                command = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if fields[0] == "Z":
                continue
            parents[int(proc.name)] = int(fields[1])
            if b"flatfare" in command and b"worker" in command:
                workers.add(int(proc.name))

        def under_up(pid: int) -> bool:
            while pid > 1:
                pid = parents.get(pid, 0)
                if pid == self.process.pid:
                    return True
            return False

        return {pid for pid in workers if under_up(pid)}

    def ask(self, model: str) -> httpx.Response:
        return httpx.post(f"{self.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {self.key}"},
                          json={"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 24},
                          timeout=COLD_WITHIN_S)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("up")
    redis = LocalRedis(folder / "redis", persist=False).start()
    port = free_port()
    env = {**os.environ, "FLATFARE_DATA_DIR": str(folder / "data"), "FLATFARE_MODELS_DIR": str(MODELS_DIR),
           "FLATFARE_REDIS_URL": redis.url, "FLATFARE_ENGINE_OPTIONS": '{"enforce_eager": true}',
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    output = folder / "up.txt"
    with output.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "flatfare", "up", "--port", str(port), "--on-demand",
                                    "--max-awake", "1"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    running = Up(process, output, redis.url, f"http://127.0.0.1:{port}")
    try:
        printed = eventually(running.printed, lambda text: "API key (shown once)" in text or process.poll() is not None,
                             "flatfare up's key", timeout_s=STACK_READY_TIMEOUT_S, every_s=1)
        match = re.search(r"API key \(shown once\): (ff-\S+)", printed)
        assert match, printed[-4000:]
        running.key = match.group(1)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        redis.stop()
    # Ctrl-C (or SIGTERM) stops everything it started: no worker is left in either pool.
    assert "stopped" in running.printed()


def test_up_answers_both_on_demand_models_one_engine_at_a_time(up: Up) -> None:
    printed = up.printed()
    # Every built-in model but the first is named on the one "started at its first request" line.
    assert f"serving {DEFAULT}" in printed and re.search(rf"\b{SECOND}\b[^\n]*: started at its first request", printed)
    first = up.ask(DEFAULT)
    assert first.status_code == 200, first.text
    assert "Paris" in first.json()["choices"][0]["message"]["content"]

    seen: list[set[str]] = []
    processes: list[set[int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(up.engines())
            processes.append(up.worker_processes())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        second = up.ask(SECOND)
    finally:
        done.set()
        watcher.join()
    assert second.status_code == 200, second.text
    assert "Paris" in second.json()["choices"][0]["message"]["content"]
    assert int(second.headers["x-flatfare-model-wait-ms"]) > 0
    assert "x-flatfare-model-wait-ms" not in first.headers
    # The default model's engine stopped to make room before the second's started: never both.
    assert max(len(s) for s in seen) == 1, [s for s in seen if len(s) > 1][:3]
    # Nor two engine processes: the second starts once the first has exited, not while it shuts down.
    assert max(len(p) for p in processes) == 1, [p for p in processes if len(p) > 1][:3]
    fleet = up.fleet()
    assert fleet is not None
    actions = [(d["action"], d["model"]) for d in fleet.decisions]
    assert actions.index(("stop", DEFAULT)) < actions.index(("start", SECOND)), actions
    assert [e["model"] for e in fleet.engines.values()] == [SECOND]
    # up tells whoever watches it what the fleet did for the request.
    eventually(up.printed, lambda text: f"fleet: start {SECOND}" in text, "up printing the fleet's news")
