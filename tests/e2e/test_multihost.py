"""Flatfare over several hosts on one machine (bench.hosts: network namespaces on a bridge, addresses
in 192.0.2.0/24 that exist only inside them): Redis and PostgreSQL on a storage host, the gateway on
another, two instant-engine worker hosts, requests from a client host. A worker host whose cable is
pulled mid-load loses no job: its leases run out and the other worker host takes its jobs over.

Needs root and ``ip netns``; skipped, saying why, where they are not available (failed under CI)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import hosts
from bench.cluster import GATEWAY_PORT, REDIS_PORT, Cluster, InstantWorker, loadgen_result
from bench.postgres import postgres_unavailable
from bench.procs import services
from tests.conftest import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

# Short leases so a cut-off host's jobs are taken over within seconds (the default is 15 s), yet
# long enough that what the cut-off host held is read before they run out: each read is a Python
# process started in the storage host's namespace, one per lane, seconds on a loaded machine.
LEASE_S = 8
# Each worker holds 4 jobs at once and answers each after 1 s: the load below keeps both busy, with
# a queue behind them, for at least 30 s, so it still runs when one is cut off. Seeing both hold jobs
# takes two reads (in the test below) before the cut: 10-20 s under scripts/stress-test.sh, where 160 requests
# answered after 0.2 s each were all done before it.
ENGINE = InstantWorker(capacity=4, delay_s=1.0)
REQUESTS = 240
CLIENTS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = hosts.unavailable() or postgres_unavailable()
    if reason:
        unavailable(reason)
    workdir: Path = tmp_path_factory.mktemp("multihost")
    with hosts.Network() as network, services() as group:
        spread = Cluster(network, group, workdir, ENGINE,
                         extra_env={"FLATFARE_JOB_LEASE_S": str(LEASE_S), "FLATFARE_DRAIN_TIMEOUT_S": "2"})
        try:
            spread.start()
            for _ in range(2):
                spread.start_worker(spread.add_worker_host())
            yield spread
        finally:
            spread.stop()


def test_the_client_host_is_answered_through_the_gateway_host(cluster: Cluster) -> None:
    answer = cluster.completion()
    assert answer["status"] == 200, answer
    assert '"object":"chat.completion"' in answer["body"]


def _root_listeners() -> set[str]:
    """The local addresses of the root namespace's listening TCP sockets."""
    listed = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in listed.splitlines()}


def test_the_hosts_addresses_exist_only_inside_the_namespaces(cluster: Cluster) -> None:
    addresses = {cluster.storage.address, cluster.gateway_host.address, cluster.client.address,
                 *(host.address for host in cluster.worker_hosts.values())}
    assert addresses.isdisjoint(hosts.root_addresses())
    assert addresses.isdisjoint(_root_listeners())
    assert cluster.client.can_connect(cluster.gateway_host.address, GATEWAY_PORT)
    for address, port in ((cluster.gateway_host.address, GATEWAY_PORT), (cluster.storage.address, REDIS_PORT)):
        with pytest.raises(OSError):  # from the root namespace: unreachable, or nothing there
            socket.create_connection((address, port), timeout=1).close()


def _wait_until_holding(cluster: Cluster, worker: str, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = cluster.held(worker)
        if held:
            return held
        time.sleep(0.1)
    raise AssertionError(f"{worker} took no job within {timeout_s:.0f} s; logs in {cluster.workdir}")


def test_a_cut_off_worker_host_loses_no_job(cluster: Cluster) -> None:
    load = cluster.loadgen("-c", str(CLIENTS), "--requests", str(REQUESTS), timeout_s=120)
    try:
        _wait_until_holding(cluster, "worker1")
        _wait_until_holding(cluster, "worker2")
        cluster.cut("worker2")
        stranded = cluster.held("worker2")
        result = loadgen_result(load, timeout_s=300)
    finally:
        if load.poll() is None:
            load.kill()
    assert stranded, "worker2 held no job when its host was cut off"
    # Every request answered, none failed, none left hanging.
    assert result["completed"] == REQUESTS, result
    assert result["errors"] == 0 and result["unfinished"] == 0, result["first_errors"]
    # worker2 could not reach Redis after the cut: the jobs it held were taken over (by worker1, the
    # only other worker) and acknowledged there.
    assert cluster.held("worker2") == []
    assert cluster.held("worker1") == []
    assert cluster.worker_state("worker1") == "warm"
    assert cluster.completion()["status"] == 200
