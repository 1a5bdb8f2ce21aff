"""Hosts on one machine: Linux network namespaces joined by a bridge on 192.0.2.0/24 (TEST-NET-1).

Each host is a namespace with its own loopback and one interface, ``eth0``, whose other end is a
port of a bridge that lives in a namespace of its own (the switch). Nothing is added to the root
namespace: the addresses exist only inside the hosts, so their traffic never leaves these
namespaces. Cutting a host sets its switch port down, as if its cable were pulled: packets to and
from it go nowhere, and nobody is told.

Namespaces are named ``ff<pid>n<k>-<host>``; :class:`Network` removes its own on exit, whatever
happened, and those of earlier runs whose process is gone. Needs root and iproute2 (``ip``);
:func:`unavailable` says why they cannot be used here. Standard library only: the tests use it too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import psutil

SUBNET = ipaddress.ip_network("192.0.2.0/24")
FIRST_HOST_ADDRESS = 10  # hosts get 192.0.2.10, .11, ... (skipping the root namespace's own)
_PREFIX = "ff"
_OURS = re.compile(rf"^{_PREFIX}(\d+)n\d+-")
_counter = itertools.count()


class NetworkError(Exception):
    """An ``ip`` command failed while building or changing the hosts' network."""


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{_PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "iproute2's `ip` command is not installed"
    except NetworkError as exc:
        return f"`ip netns add` is not allowed here: {exc}"
    with contextlib.suppress(NetworkError):
        _ip("netns", "delete", probe)
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _remove_namespace(name: str) -> None:
    """Kill what still runs in ``name`` (processes a run started there), then delete it."""
    with contextlib.suppress(NetworkError):
        for _ in range(50):
            pids = [int(p) for p in _ip("netns", "pids", name).split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        _ip("netns", "delete", name)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (killed before it cleaned up)."""
    removed = []
    for name in _namespaces():
        match = _OURS.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One namespace on the bridge, with ``address`` on its ``eth0``."""

    name: str
    netns: str
    address: str
    network: Network = field(repr=False)

    @property
    def port(self) -> str:
        """Its port on the switch (an interface in the switch's namespace)."""
        return f"p-{self.name}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], timeout_s: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                              **kwargs)  # type: ignore[call-overload]

    def can_connect(self, address: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from this host to ``address:port`` opens."""
        probe = f"exec 3<>/dev/tcp/{address}/{port}"
        try:
            return self.run(["timeout", str(timeout_s), "bash", "-c", probe], timeout_s=timeout_s + 5).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def cut(self) -> None:
        """Pull its cable: its switch port goes down."""
        self.network.set_port(self, up=False)

    def reconnect(self) -> None:
        self.network.set_port(self, up=True)


class Network:
    """A switch and the hosts on it; use as a context manager, which removes them all on exit."""

    def __init__(self) -> None:
        self.id = f"{_PREFIX}{os.getpid()}n{next(_counter)}"
        self.switch = f"{self.id}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []

    def __enter__(self) -> Self:
        remove_stale()
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new host on the switch, with the next free address of :data:`SUBNET`."""
        if name in self.hosts or len(f"p-{name}") > 15:  # Linux interface names: 15 characters
            raise ValueError(f"host name {name!r} is taken or longer than 13 characters")
        address = self._next_address()
        host = Host(name, f"{self.id}-{name}", address, self)
        self._add_namespace(host.netns)
        # Made inside the switch's namespace with its peer moved straight into the host's: neither
        # end ever sits in the root namespace.
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    def _next_address(self) -> str:
        # The machine's own network may be 192.0.2.0/24 too (it is on some CI VMs): skip its
        # addresses, so that "this address is not the root namespace's" stays checkable.
        taken = {host.address for host in self.hosts.values()} | set(root_addresses())
        for offset in range(FIRST_HOST_ADDRESS, SUBNET.num_addresses - 1):
            address = str(SUBNET.network_address + offset)
            if address not in taken:
                return address
        raise NetworkError(f"no free address left in {SUBNET}")

    def set_port(self, host: Host, up: bool) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up" if up else "down")

    def close(self) -> None:
        for name in reversed(self._made):
            _remove_namespace(name)
        self._made.clear()
        self.hosts.clear()


def root_addresses() -> list[str]:
    """Every address of the root namespace (the one this process runs in), for checks that the
    hosts' addresses are not among them."""
    return [line.split()[3].split("/")[0] for line in _ip("-o", "addr", "show").splitlines()]
