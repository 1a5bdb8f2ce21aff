"""The H200 recipe's setup, minus the GPU: `python -m bench gpu prepare` builds Flatfare's wheel and
`bench/gpu_device.sh setup` installs it into a ``--target`` folder, so the device runs Flatfare from the
installed package, never from the source tree (whose top-level gateway/, workers/, billing/ and migrations/
become flatfare.* only through the wheel's package-dir mapping).

The wheel comes from the very function `prepare` calls; the install, its check and bench's Flatfare stack
run through the very script (`gpu_device.sh install-flatfare`, which `setup` runs too, and `gpu_device.sh
python`, python3 with the path and folder `run` gives bench.engine). The device's python3 has no editable
install of Flatfare; here the commands run on a venv made without pip whose only link to this test run's
packages is a .pth naming the venv's site-packages folder: Python adds the folder but runs none of the .pth
files inside it, so the editable install's import hook (which would map flatfare.gateway to gateway/ for
any python) never loads, and the source tree on PYTHONPATH fails as it failed on the device.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import gpu
from flatfare.storage.db import alembic_config
from flatfare.storage.models import Base
from tests.deploy.files import REPO

COMMAND_TIMEOUT_S = 300
SCRIPT = REPO / "bench" / "gpu_device.sh"


@dataclass
class Recipe:
    workdir: Path
    python: Path  # the device's python3, in miniature: no editable install, no pip of its own
    wheels: Path  # gpu prepare's .gpu_wheels
    site: Path  # gpu_device.sh's /tmp/ffsite
    bench: Path  # its /tmp/ffbench (a link to bench/, nothing else)
    home: Path  # a folder outside the checkout

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": f"{self.python.parent}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(self.home),
                "LANG": "C.UTF-8", "TMPDIR": str(self.home), "FLATFARE_DATA_DIR": str(self.home / "data"), **extra}

    def script(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """`bash bench/gpu_device.sh ARGS` as the device runs it, with this recipe's folders and python
        (and no /tmp/vllm_env.sh: there is no vLLM payload here)."""
        env = self.env(FFSITE=str(self.site), FFBENCH=str(self.bench), GPU_WHEELS=str(self.wheels),
                       PYTHON=str(self.python), VLLM_ENV=str(self.workdir / "no-vllm-env.sh"), **extra)
        return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)

    def python_run(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.python), *args], cwd=self.home, env=self.env(**extra), capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    workdir = tmp_path_factory.mktemp("gpu_recipe")
    assert REPO not in workdir.parents, "the wheel must be installed outside the checkout"
    wheels = workdir / "wheels"
    gpu.build_flatfare_wheel(wheels / gpu.FLATFARE_WHEEL_DIR)
    venv = workdir / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=COMMAND_TIMEOUT_S)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site_packages / "flatfare-test-dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    home = workdir / "elsewhere"
    home.mkdir()
    return Recipe(workdir=workdir, python=venv / "bin" / "python", wheels=wheels, site=workdir / "ffsite",
                  bench=workdir / "ffbench", home=home)


@pytest.fixture(scope="module")
def installed(recipe: Recipe) -> subprocess.CompletedProcess[str]:
    """`gpu_device.sh install-flatfare`: the wheel into the --target folder, then the script's own check."""
    return recipe.script("install-flatfare")


def test_setup_installs_the_wheel_and_its_check_passes_in_the_checkout(
        recipe: Recipe, installed: subprocess.CompletedProcess[str]) -> None:
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert f"flatfare imports from {recipe.site.resolve() / 'flatfare'}" in installed.stdout
    assert "flatfare migrate: a new SQLite file at head" in installed.stdout
    assert (recipe.site / "flatfare" / "migrations" / "env.py").is_file()
    assert (recipe.site / "bin" / "flatfare").is_file()
    assert not (recipe.site / "bench").exists() and not (recipe.site / "gateway").exists()


def _migrate_outside_the_checkout(recipe: Recipe, pythonpath: Path,
                                  database: Path) -> subprocess.CompletedProcess[str]:
    """`python -m flatfare migrate` in a folder outside the checkout, with only ``pythonpath`` on the path."""
    return recipe.python_run("-m", "flatfare", "migrate", PYTHONPATH=str(pythonpath),
                             FLATFARE_DATABASE_URL=f"sqlite:///{database}")


def test_the_installed_wheel_migrates_a_new_database_to_head(recipe: Recipe,
                                                             installed: subprocess.CompletedProcess[str]) -> None:
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = recipe.python_run("-c", "import flatfare.migrations; print(flatfare.migrations.__file__)",
                              PYTHONPATH=str(recipe.site))
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(recipe.site / "flatfare"), where.stdout
    database = recipe.home / "ledger.db"
    done = _migrate_outside_the_checkout(recipe, recipe.site, database)
    assert done.returncode == 0, done.stderr
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(f"sqlite:///{database}")).get_current_head()  # the checkout's
    with sqlite3.connect(database) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    assert version == head


def test_the_checkout_on_pythonpath_cannot_migrate(recipe: Recipe) -> None:
    """What the recipe did before (PYTHONPATH=$ROOT): the bare source tree has no flatfare.migrations. This
    also shows the python above cannot reach the checkout's modules by any other way."""
    database = recipe.home / "from-source.db"
    done = _migrate_outside_the_checkout(recipe, REPO, database)
    assert done.returncode != 0, "the source tree migrated: this python reaches the checkout's modules"
    assert "ModuleNotFoundError: No module named 'flatfare.migrations'" in done.stderr, done.stderr
    assert not database.exists() or database.stat().st_size == 0


def test_the_check_refuses_the_source_tree_ahead_of_the_wheel(recipe: Recipe,
                                                              installed: subprocess.CompletedProcess[str]) -> None:
    assert installed.returncode == 0, installed.stdout + installed.stderr
    done = recipe.script("check-flatfare", PYTHONPATH=str(REPO))
    assert done.returncode != 0, done.stdout
    assert f"flatfare comes from {REPO / 'flatfare'}" in done.stderr and "shadows the wheel" in done.stderr, done.stderr


# bench.engine's Flatfare half as `gpu_device.sh run` starts it (its python, path and folder), with the instant
# engine instead of vLLM: migrate, a key, a worker and a gateway answering one request.
STACK = """
import tempfile
from pathlib import Path
import bench, flatfare
from bench.procs import services
from bench.stack import FlatfareStack, http_post
print(flatfare.__file__, bench.__file__, sep="\\n")
with tempfile.TemporaryDirectory() as tmp, services() as group:
    stack = FlatfareStack(group, Path(tmp) / "flatfare", "instant", ["--engine", "instant"])
    try:
        stack.start_storage()
        stack.start_worker(120)
        stack.start_gateway(120)
        status, _ = http_post(stack.base_url + "/v1/completions", stack.key,
                                 {"model": "instant", "prompt": "Hi", "max_tokens": 2})
        print(status)
    finally:
        stack.stop()
"""


def test_the_bench_stack_runs_flatfare_from_the_wheel(recipe: Recipe,
                                                      installed: subprocess.CompletedProcess[str]) -> None:
    assert installed.returncode == 0, installed.stdout + installed.stderr
    done = recipe.script("python", "-c", STACK)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    flatfare_file, bench_file, status = done.stdout.split()
    assert Path(flatfare_file).is_relative_to(recipe.site / "flatfare"), flatfare_file
    assert Path(bench_file) == recipe.bench / "bench" / "__init__.py", bench_file
    assert status == "200"
