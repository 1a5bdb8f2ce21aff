"""A throwaway PostgreSQL cluster for the benchmarks and tests that need one of their own: initdb in a
temporary folder, run as user ``postgres`` (it refuses root), listening on one address, database
``flatfare``, durability off (the cluster is deleted afterwards). It can be stopped and started
again on its data (the fault benchmark), and run inside a network namespace (the multi-host bench:
``wrap`` puts a command inside the host)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.procs import Service, Services, free_port


class PostgresError(Exception):
    """A step of the private cluster failed (its stderr is in the message)."""


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server binaries (initdb, postgres), newest version first."""
    found = shutil.which("initdb")
    if found:  # often a link in /usr/local/bin: the other binaries sit beside its target
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


def postgres_unavailable() -> str | None:
    """Why a private PostgreSQL cluster cannot be started here, or None."""
    if postgres_bin() is None:
        return "PostgreSQL's server binaries (initdb, postgres) are not installed"
    if os.geteuid() != 0:
        return "running the cluster as user `postgres` needs root"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no `postgres` user to run a private PostgreSQL cluster as (it refuses to run as root)"
    return None


class PrivatePostgres:
    def __init__(self, services: Services, log_dir: Path, *, address: str = "127.0.0.1", port: int | None = None,
                 trust: str = "", wrap: Callable[[Sequence[str]], list[str]] = list) -> None:
        self.services = services
        self.log_dir = log_dir
        self.address = address
        self.port = port or free_port()
        self._trust = trust  # a subnet allowed in besides the address itself
        self._wrap = wrap
        self.folder: Path | None = None
        self.service: Service | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.address}:{self.port}/flatfare"

    def _as_postgres(self, *argv: str) -> list[str]:
        return self._wrap(["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv])

    def _run(self, *argv: str) -> None:
        done = subprocess.run(self._as_postgres(*argv), capture_output=True, text=True, timeout=120, check=False,
                              cwd="/")
        if done.returncode != 0:
            raise PostgresError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-1500:]}")

    def start(self) -> PrivatePostgres:
        """Make the cluster, run it, and create the database ``flatfare``."""
        reason = postgres_unavailable()
        if reason:
            raise PostgresError(reason)
        binaries = postgres_bin()
        assert binaries is not None
        user = pwd.getpwnam("postgres")
        # Not under the caller's folder: the postgres user must reach it (pytest's are root's only).
        self.folder = Path(tempfile.mkdtemp(prefix="ff-postgres-"))
        os.chown(self.folder, user.pw_uid, user.pw_gid)
        data = self.folder / "data"
        self._run(str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync",
                  "-E", "UTF8", "--locale=C")
        if self._trust:
            with (data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self._trust} trust\n")
        self.resume()
        self._run(str(binaries / "createdb"), "-h", self.address, "-p", str(self.port), "flatfare")
        return self

    def resume(self) -> None:
        """Run the server on the cluster's data (again)."""
        binaries = postgres_bin()
        assert binaries is not None and self.folder is not None
        options = {"listen_addresses": self.address, "port": self.port, "unix_socket_directories": str(self.folder),
                   "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": 300}
        argv = [str(binaries / "postgres"), "-D", str(self.folder / "data")]
        for name, value in options.items():
            argv += ["-c", f"{name}={value}"]
        self.service = self.services.start(Service("postgres", self._as_postgres(*argv),
                                                   self.log_dir / "postgres.log", cwd="/"))
        isready = [str(binaries / "pg_isready"), "-q", "-h", self.address, "-p", str(self.port)]
        self.service.wait_ready(
            lambda: subprocess.run(self._as_postgres(*isready), check=False, timeout=30).returncode == 0, 60)

    def pause(self) -> None:
        """Stop the server as `pg_ctl stop -m fast` does (SIGINT: clients cut, data kept)."""
        if self.service is None or self.service.process is None:
            return
        os.killpg(self.service.pid, signal.SIGINT)
        self.service.process.wait(timeout=60)
        self.services.stop(self.service)
        self.service = None

    def stop(self) -> None:
        """Stop the server and delete the cluster."""
        if self.service is not None:
            self.services.stop(self.service)
            self.service = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
