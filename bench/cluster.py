"""Flatfare spread over hosts (bench.hosts), started the way an operator would on separate machines.

- ``storage``: ``redis-server`` and a private PostgreSQL cluster, both listening on its 192.0.2
  address only;
- ``gateway``: ``flatfare migrate``, ``flatfare keys create`` and ``flatfare gateway --host <its
  address>``, pointed at the storage host by FLATFARE_REDIS_URL and FLATFARE_DATABASE_URL;
- one host per worker (``worker1``, ``worker2``, ...): ``flatfare worker --engine instant``, which
  needs Redis only (its worker id is its host's name);
- ``client``: where requests come from (``bench.loadgen``, ``bench.probe``).

The workers run the instant engine made capacity-bound like a GPU: each holds ``capacity`` requests
at once and answers each after ``delay_s``, so a worker serves about ``capacity / delay_s`` requests
a second however fast the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.hosts import SUBNET, Host, Network
from bench.postgres import PrivatePostgres
from bench.procs import Service, Services
from flatfare import contract
from flatfare.redis_local import redis_server_binary

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "instant"
REDIS_PORT = 6379
POSTGRES_PORT = 5432
GATEWAY_PORT = 8000


class ClusterError(Exception):
    """A part of the spread-out platform could not start; the message says which and why."""


@dataclass(frozen=True)
class InstantWorker:
    """The instant engine's settings on every worker host."""

    capacity: int = 8
    delay_s: float = 0.05
    tokens: int = 16

    def env(self) -> dict[str, str]:
        return {"FLATFARE_INSTANT_TOKENS": str(self.tokens), "FLATFARE_INSTANT_FIRST_TOKEN_DELAY_S": str(self.delay_s)}


class Cluster:
    """Storage, gateway and client hosts on ``network``; worker hosts are added with
    :meth:`add_worker_host`, their workers started and stopped with :meth:`start_worker` /
    :meth:`stop_worker`; :meth:`cut` pulls a worker host's cable."""

    def __init__(self, network: Network, services: Services, workdir: Path, engine: InstantWorker,
                 extra_env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.network = network
        self.services = services
        self.workdir = workdir
        self.engine = engine
        self.extra_env = extra_env or {}
        self.python = python
        self.storage = network.add_host("storage")
        self.gateway_host = network.add_host("gateway")
        self.client = network.add_host("client")
        self.postgres = PrivatePostgres(services, workdir / "storage", address=self.storage.address,
                                        port=POSTGRES_PORT, trust=SUBNET, wrap=self.storage.argv)
        self.redis: Service | None = None
        self.gateway: Service | None = None
        self.workers: dict[str, Service] = {}
        self.worker_hosts: dict[str, Host] = {}
        self.cut_off: set[str] = set()
        self.key = ""

    @property
    def redis_url(self) -> str:
        return f"redis://{self.storage.address}:{REDIS_PORT}/0"

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway_host.address}:{GATEWAY_PORT}"

    def env(self, host: Host) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "FLATFARE_DATA_DIR": str(self.workdir / host.name),
            "FLATFARE_REDIS_URL": self.redis_url,
            "FLATFARE_LOG_LEVEL": "warning",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])),
        })
        env.update(self.extra_env)
        return env

    def _flatfare(self, host: Host, *args: str) -> list[str]:
        return host.argv([self.python, "-m", "flatfare", *args])

    def _start(self, host: Host, name: str, argv: list[str], env: dict[str, str]) -> Service:
        folder = self.workdir / host.name
        folder.mkdir(parents=True, exist_ok=True)
        return self.services.start(Service(name, argv, folder / f"{name}.log", env=env, cwd=str(folder)))

    # -- storage and gateway -----------------------------------------------------------------

    def start(self) -> Cluster:
        """Redis and PostgreSQL on the storage host, then the gateway (migrated, with a key)."""
        self.start_storage()
        self.start_gateway()
        return self

    def start_storage(self) -> None:
        self.postgres.start()
        folder = self.workdir / self.storage.name
        self.redis = self._start(self.storage, "redis", self.storage.argv([
            redis_server_binary(), "--bind", self.storage.address, "--port", str(REDIS_PORT), "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(folder)]), dict(os.environ))
        self.redis.wait_ready(lambda: self.storage.can_connect(self.storage.address, REDIS_PORT), 30)

    def start_gateway(self, ready_timeout_s: float = 90) -> None:
        env = {**self.env(self.gateway_host), "FLATFARE_DATABASE_URL": self.postgres.url}
        folder = self.workdir / self.gateway_host.name
        folder.mkdir(parents=True, exist_ok=True)
        for step in (("migrate",), ("keys", "create", "--account", "multihost", "--plan", "enterprise")):
            done = subprocess.run(self._flatfare(self.gateway_host, *step), env=env, cwd=folder, capture_output=True,
                                  text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise ClusterError(f"`flatfare {' '.join(step)}` failed on the gateway host: {done.stderr[-2000:]}")
        self.key = done.stdout.strip().splitlines()[-1]
        self.gateway = self._start(self.gateway_host, "gateway", self._flatfare(
            self.gateway_host, "gateway", "--host", self.gateway_host.address, "--port", str(GATEWAY_PORT)), env)
        self.gateway.wait_ready(lambda: self.client.can_connect(self.gateway_host.address, GATEWAY_PORT),
                                ready_timeout_s)

    # -- workers -----------------------------------------------------------------------------

    def add_worker_host(self) -> str:
        """One more host for a worker, ``worker<n>``; :meth:`start_worker` starts one on it."""
        name = f"worker{len(self.worker_hosts) + 1}"
        self.worker_hosts[name] = self.network.add_host(name)
        return name

    def start_worker(self, name: str, ready_timeout_s: float = 60) -> None:
        """An instant-engine worker on host ``name`` (its worker id too), waited for until it is warm."""
        host = self.worker_hosts[name]
        env = {**self.env(host), **self.engine.env(), "FLATFARE_WORKER_ID": name}
        service = self.workers[name] = self._start(host, "worker", self._flatfare(
            host, "worker", "--model", MODEL, "--engine", "instant", "--max-inflight", str(self.engine.capacity)), env)
        service.wait_ready(lambda: self.worker_state(name) == "warm", ready_timeout_s)

    def worker_state(self, name: str) -> str | None:
        return self.redis_command("HGET", contract.worker_key(name), "state")

    def stop_worker(self, name: str) -> None:
        """Stop the worker on host ``name``: it drains first, unless its host was cut off."""
        service = self.workers.pop(name)
        if name in self.cut_off:  # its host is gone from the network: nothing to drain
            service.stop(timeout_s=0.1)
        self.services.stop(service)

    def cut(self, name: str) -> None:
        """Pull the worker host's cable: its leases stop being renewed, its replies go nowhere."""
        self.worker_hosts[name].cut()
        self.cut_off.add(name)

    # -- from inside the hosts ---------------------------------------------------------------

    def _probe(self, host: Host, *args: str, timeout_s: float = 60) -> Any:
        done = host.run([self.python, "-m", "bench.probe", *args], timeout_s=timeout_s, cwd=str(REPO_ROOT),
                        env=self.env(host))
        if done.returncode != 0:
            raise ClusterError(f"bench.probe {args[0]} failed on {host.name}: {done.stderr.strip()[-1500:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def redis_command(self, *command: str) -> Any:
        """One Redis command, sent from the storage host."""
        return self._probe(self.storage, "redis", self.redis_url, *command)

    def held(self, worker: str) -> list[str]:
        """The jobs ``worker`` holds (claimed, not yet acknowledged): their lane streams' entry ids."""
        held = []
        for lane in contract.Lane:
            pending = self.redis_command("XPENDING", contract.job_stream(MODEL, lane), contract.POOL_GROUP,
                                         "-", "+", "10000", worker)
            held += [entry[0] for entry in pending]
        return held

    def completion(self, timeout_s: float = 10) -> dict[str, Any]:
        """One chat completion from the client host: ``{"status": ..., "body": ...}``."""
        return self._probe(self.client, "completion", self.base_url, self.key, MODEL, "--timeout", str(timeout_s),
                           timeout_s=timeout_s + 30)

    def loadgen(self, *args: str, timeout_s: float = 600) -> subprocess.Popen[str]:
        """``bench.loadgen`` against the gateway, started on the client host; it prints one JSON line."""
        argv = self.client.argv([self.python, "-m", "bench.loadgen", "--url", f"{self.base_url}/v1/chat/completions",
                                 "--key", self.key, "--model", MODEL, "--timeout", str(timeout_s), *args])
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                                env=self.env(self.client))

    def stop(self) -> None:
        for name in list(self.workers):
            self.stop_worker(name)
        for service in (self.gateway, self.redis):
            if service is not None:
                self.services.stop(service)
        self.gateway = self.redis = None
        self.postgres.stop()


def loadgen_result(process: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The JSON line a load generator started by :meth:`Cluster.loadgen` printed."""
    out, err = process.communicate(timeout=timeout_s)
    if process.returncode != 0:
        raise ClusterError(f"the load generator failed: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])
