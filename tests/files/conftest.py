"""Live platforms for the Files API: the gateway (two processes) with an instant-engine worker on real Redis,
on SQLite and PostgreSQL with the local store, and on SQLite with the S3 store against moto's S3 server
(S3 faked at its HTTP edge; boto3 talks to it as to AWS)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from openai import OpenAI

from flatfare.redis_local import free_port
from tests.conftest import Stack, launch_stack, postgres_database

MIB = 1024 * 1024
# Small caps, so the tests reach them with small files.
MAX_BYTES = 1 * MIB
ACCOUNT_MAX_BYTES = 2 * MIB + MIB // 2
ACCOUNT_MAX_FILES = 4
BUCKET = "flatfare-files"
_accounts = itertools.count(1)


@dataclass
class S3Server:
    url: str

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        listed = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for item in listed.get("Contents", [])]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3Server(f"http://127.0.0.1:{port}")
    s3.client().create_bucket(Bucket=BUCKET)
    yield s3
    server.stop()


@dataclass
class FilesPlatform:
    stack: Stack
    backend: str
    s3: S3Server | None
    files_dir: Path

    def new_account(self) -> tuple[int, OpenAI]:
        """A fresh account (its own caps) and an SDK client with its key."""
        name = f"files-{next(_accounts)}"
        created = self.stack.cli("keys", "create", "--account", name, "--plan", "pro")
        assert created.returncode == 0, created.stderr
        account = self.stack.sql("SELECT id FROM accounts WHERE name = :name", name=name)[0][0]
        return account, OpenAI(base_url=f"{self.stack.base_url}/v1", api_key=created.stdout.strip(), max_retries=0)

    def stored_objects(self, account: int) -> list[str]:
        """What the file store holds for the account."""
        if self.s3 is not None:
            return sorted(key.removeprefix(f"{account}/") for key in self.s3.keys(f"{account}/"))
        folder = self.files_dir / str(account)
        return sorted(path.name for path in folder.iterdir()) if folder.exists() else []

    def spooled(self) -> list[str]:
        """Uploads still spooled on the gateway's disk (none once each upload was answered)."""
        return [path.name for path in (self.stack.logs.parent / "uploads").iterdir()]

    def rows(self, account: int) -> list[tuple]:
        return self.stack.sql("SELECT id, bytes FROM files WHERE account_id = :a", a=account)

    def usage(self, account: int) -> tuple[int, int]:
        found = self.stack.sql("SELECT files, bytes FROM file_usage WHERE account_id = :a", a=account)
        return tuple(found[0]) if found else (0, 0)  # type: ignore[return-value]


@contextmanager
def _postgres() -> Iterator[str]:
    yield from postgres_database()


@pytest.fixture(scope="module", params=["sqlite-local", pytest.param("postgresql-local", marks=pytest.mark.postgres),
                                        "sqlite-s3"])
def platform(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FilesPlatform]:
    database, backend = request.param.split("-")
    data = tmp_path_factory.mktemp(f"files-{request.param}")
    env = {"FLATFARE_FILES_MAX_BYTES": str(MAX_BYTES), "FLATFARE_FILES_ACCOUNT_MAX_BYTES": str(ACCOUNT_MAX_BYTES),
           "FLATFARE_FILES_ACCOUNT_MAX_FILES": str(ACCOUNT_MAX_FILES), "FLATFARE_FILES_SWEEP_INTERVAL_S": "0.5",
           "FLATFARE_FILES_DIR": str(data / "files")}
    with ExitStack() as stack:
        s3 = None
        if backend == "s3":
            s3 = request.getfixturevalue("s3_server")
            env |= {"FLATFARE_FILES_BACKEND": "s3", "FLATFARE_FILES_S3_BUCKET": BUCKET,
                    "FLATFARE_FILES_S3_ENDPOINT_URL": s3.url, "FLATFARE_FILES_S3_REGION": "us-east-1",
                    "FLATFARE_FILES_S3_ACCESS_KEY_ID": "testing", "FLATFARE_FILES_S3_SECRET_ACCESS_KEY": "testing"}
        url = None
        if database == "postgresql":
            url = stack.enter_context(_postgres())
        live = stack.enter_context(launch_stack(data, model="instant", worker_args=("--engine", "instant"),
                                                gateway_processes=2, env=env, database_url=url))
        yield FilesPlatform(live, backend, s3, data / "files")
