"""Flatfare's wheel, installed away from the source tree: it carries the migrations, and `flatfare migrate`,
`gateway` and `worker` run from it in any folder.

The wheel is built as the images' first stage builds it (deploy/docker/*.Dockerfile): from a copy of the
files that stage copies, with `pip wheel --no-deps`, here without build isolation (offline: the test
extra brings setuptools). It is then installed with `pip install --no-deps` into a fresh venv, made
without pip and without the system's site-packages. Its dependencies come from this test run's venv
through a .pth file in the fresh venv that names that venv's site-packages folder: Python adds the
folder to sys.path but does not run the .pth files inside it, so the editable install's import hook
(which maps `flatfare` to this checkout) never loads. The commands run with a bare environment (no
PYTHONPATH) in a folder outside the checkout, so nothing but the wheel can supply Flatfare's files.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from flatfare.redis_local import free_port
from flatfare.storage.db import alembic_config
from flatfare.storage.models import Base
from tests.conftest import stop_process
from tests.deploy.files import DOCKERFILES, REPO, docker_ignored, package_roots
from tests.deploy.test_images import wheel_sources

COMMAND_TIMEOUT_S = 120
READY_TIMEOUT_S = 120


@dataclass
class WheelEnv:
    wheel: Path
    venv: Path
    site_packages: Path
    home: Path  # a folder outside the checkout: the commands' working directory and HOME

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": f"{self.venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(self.home),
                "LANG": "C.UTF-8", "FLATFARE_DATA_DIR": str(self.home / "data"), **extra}

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=self.home, env=self.env(**extra), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)

    def flatfare(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "flatfare"), *args, **extra)


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def _build_wheel(workdir: Path) -> Path:
    """The images' wheel stage, outside Docker: its COPY lines, then its `pip wheel`."""
    source = workdir / "src"

    def ignore(folder: str, names: list[str]) -> set[str]:
        relative = Path(folder).relative_to(REPO)
        return {n for n in names if docker_ignored(str(relative / n)) or docker_ignored(n)}

    for copied, destination in wheel_sources(DOCKERFILES[0]):
        target = source / destination
        if (REPO / copied).is_dir():
            shutil.copytree(REPO / copied, target, ignore=ignore)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / copied, target / Path(copied).name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--check-build-dependencies", "--wheel-dir",
         str(workdir / "dist"), str(source))
    (wheel,) = (workdir / "dist").glob("flatfare-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> WheelEnv:
    workdir = tmp_path_factory.mktemp("wheel")
    assert REPO not in workdir.parents, "the wheel must be installed outside the checkout"
    wheel = _build_wheel(workdir)
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=COMMAND_TIMEOUT_S)
    # This venv's pip, working on the fresh one. The wheel goes in before the .pth below: pip then sees an
    # empty environment (and can never take this checkout's editable install for one to replace).
    _pip("--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel))
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site_packages / "flatfare-test-dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    home = workdir / "elsewhere"
    home.mkdir()
    return WheelEnv(wheel=wheel, venv=venv, site_packages=site_packages, home=home)


def _installed_name(relative: Path) -> Path:
    """Where a source file lands in the wheel: the top-level folders install under ``flatfare``."""
    top = relative.parts[0]
    return relative if top == "flatfare" else Path("flatfare", *relative.parts)


def _source_files() -> set[str]:
    """Every module and alembic file of the source tree, named as the wheel names them."""
    names = set()
    for root in package_roots():
        for path in (REPO / root).rglob("*"):
            relative = path.relative_to(REPO)
            if path.is_file() and not any(docker_ignored(str(p)) for p in (relative, *relative.parents)) \
                    and path.suffix in {".py", ".mako"}:
                names.add(_installed_name(relative).as_posix())
    return names


def test_the_wheel_carries_every_module_and_the_migrations(installed: WheelEnv) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    missing = _source_files() - names
    assert not missing, f"not in the wheel (add the package to [tool.setuptools] packages): {sorted(missing)}"
    assert {"flatfare/migrations/env.py", "flatfare/migrations/script.py.mako",
            "flatfare/migrations/versions/0001_initial.py", "flatfare/gateway/app.py",
            "flatfare/workers/main.py", "flatfare/billing/ledger.py"} <= names


def test_the_wheel_has_one_top_level_package_and_no_benchmarks(installed: WheelEnv) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
        top_level = next(n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt"))
        declared = wheel.read(top_level).decode().split()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"flatfare"}
    assert declared == ["flatfare"]


def test_the_packages_import_from_the_installed_wheel(installed: WheelEnv) -> None:
    code = ("import importlib.util, flatfare, flatfare.migrations, flatfare.cli.main, flatfare.gateway.app, "
            "flatfare.workers.main, flatfare.billing.ledger\n"
            "from flatfare.storage.db import migrations_dir\n"
            "for m in (flatfare, flatfare.gateway, flatfare.workers, flatfare.billing, flatfare.migrations): "
            "print(m.__file__)\n"
            "print(migrations_dir())\n"
            "print(*(importlib.util.find_spec(n) is None for n in ('gateway', 'workers', 'billing', 'bench')))\n")
    done = installed.run("python", "-c", code)
    assert done.returncode == 0, done.stderr
    *files, absent = done.stdout.splitlines()
    assert absent == "True True True True", "a bare top-level package is importable from the wheel"
    assert len(files) == 6
    for file in files:
        assert Path(file).is_relative_to(installed.site_packages / "flatfare"), file
        assert not Path(file).is_relative_to(REPO), file
    assert Path(files[-1]) == installed.site_packages / "flatfare" / "migrations"


def test_migrate_from_any_folder_brings_a_new_database_to_head(installed: WheelEnv) -> None:
    database = installed.home / "ledger.db"
    url = f"sqlite:///{database}"
    done = installed.flatfare("migrate", FLATFARE_DATABASE_URL=url)
    assert done.returncode == 0, done.stderr
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()  # the checkout's migrations
    with sqlite3.connect(database) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    assert version == head


@pytest.mark.parametrize("command", ["up", "gateway", "worker", "migrate", "keys"])
def test_the_commands_start(installed: WheelEnv, command: str) -> None:
    done = installed.flatfare(command, "--help")
    assert done.returncode == 0, done.stderr
    assert f"flatfare {command}" in done.stdout


@pytest.fixture
def served(installed: WheelEnv, redis_url: str) -> Iterator[tuple[str, str]]:
    """`flatfare migrate`, `keys create`, `gateway` and `worker` (the instant engine: no model) from the wheel."""
    data = installed.home / f"stack-{free_port()}"
    data.mkdir()
    settings = {"FLATFARE_DATABASE_URL": f"sqlite:///{data / 'flatfare.db'}", "FLATFARE_REDIS_URL": redis_url,
                "FLATFARE_DATA_DIR": str(data)}
    assert (migrated := installed.flatfare("migrate", **settings)).returncode == 0, migrated.stderr
    created = installed.flatfare("keys", "create", "--account", "wheel", "--plan", "pro", **settings)
    assert created.returncode == 0, created.stderr
    port = free_port()
    flatfare = str(installed.venv / "bin" / "flatfare")
    logs = {name: data / f"{name}.log" for name in ("gateway", "worker")}
    processes = {
        "gateway": subprocess.Popen([flatfare, "gateway", "--port", str(port)], cwd=installed.home,
                                    env=installed.env(**settings), stdout=logs["gateway"].open("wb"),
                                    stderr=subprocess.STDOUT),
        "worker": subprocess.Popen([flatfare, "worker", "--engine", "instant", "--model", "instant"],
                                   cwd=installed.home, env=installed.env(**settings),
                                   stdout=logs["worker"].open("wb"), stderr=subprocess.STDOUT),
    }
    base_url, key = f"http://127.0.0.1:{port}", created.stdout.strip()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for name, process in processes.items():
                assert process.poll() is None, f"the {name} exited:\n{logs[name].read_text()[-4000:]}"
            try:
                models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
                if models.status_code == 200 and "instant" in {m["id"] for m in models.json()["data"]}:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready within {READY_TIMEOUT_S} s; logs in {data}"
            time.sleep(0.2)
        yield base_url, key
    finally:
        for process in processes.values():
            stop_process(process)


def test_the_installed_gateway_and_worker_answer_a_request(served: tuple[str, str]) -> None:
    base_url, key = served
    reply = httpx.post(f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "instant", "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
