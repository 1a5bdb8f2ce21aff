"""Loading the deployment files, and the metric names their PromQL queries use."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
RULES_FILE = DEPLOY / "prometheus" / "rules" / "flatfare.yml"
DASHBOARD_FILE = DEPLOY / "grafana" / "dashboards" / "flatfare.json"
# Every provisioned dashboard: the platform's (flatfare.json) and each plan's promise (flatfare-plans.json).
DASHBOARD_FILES = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
K8S = DEPLOY / "k8s"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def interpolate(value: Any, environ: dict[str, str]) -> Any:
    """Compose's variable substitution (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``), applied to
    every string of a loaded file; ``$$`` stays a literal dollar sign."""
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        current = environ.get(name)
        if op in (":-", "-"):
            unset = current is None or (op == ":-" and current == "")
            return arg if unset else current
        if op in (":?", "?") and (current is None or (op == ":?" and current == "")):
            raise KeyError(f"{name}: {arg}")
        if current is None:
            raise KeyError(f"{name} is not set and has no default")
        return current

    return _VARIABLE.sub(substitute, value.replace("$$", "\0")).replace("\0", "$")


def compose(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as `docker compose config` would see it with no .env (YAML merge keys
    resolved, variables replaced by their defaults)."""
    return interpolate(load_yaml(COMPOSE_FILE), {} if environ is None else environ)


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def package_roots() -> set[str]:
    """The folders (relative to the repository) that hold the wheel's top-level packages, with
    pyproject.toml's package-dir mapping applied (flatfare.migrations comes from migrations/)."""
    setuptools = pyproject()["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    roots = set()
    for package in setuptools["packages"]:
        mapped = next((mapping[p] for p in sorted(mapping, key=len, reverse=True)
                       if package == p or package.startswith(p + ".")), None)
        roots.add(mapped.split("/")[0] if mapped else package.split(".")[0])
    return roots


# -- Dockerfiles -----------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def copies(self) -> list[tuple[dict[str, str], list[str], str]]:
        """Each COPY as (flags such as ``from``, sources, destination)."""
        found = []
        for op, args in self.steps:
            if op == "COPY":
                words = args.split()
                flags = dict(w.removeprefix("--").partition("=")[::2] for w in words if w.startswith("--"))
                *sources, destination = [w for w in words if not w.startswith("--")]
                found.append((flags, sources, destination))
        return found

    def runs(self) -> list[str]:
        return [args for op, args in self.steps if op == "RUN"]


def dockerfile_stages(path: Path) -> tuple[list[tuple[str, str]], list[Stage]]:
    """A Dockerfile as (the instructions before its first FROM, its stages); continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    preamble: list[tuple[str, str]] = []
    stages: list[Stage] = []
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        op, args = op.upper(), args.strip()
        if op == "FROM":
            base, _, name = re.sub(r"\s+as\s+", " AS ", args, flags=re.IGNORECASE).partition(" AS ")
            stages.append(Stage(base=base.strip(), name=name.strip() or None))
        elif stages:
            stages[-1].steps.append((op, args))
        else:
            preamble.append((op, args))
    return preamble, stages


def docker_ignored(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` (a path in the repository) out of the build context."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(relative, p.removeprefix("**/")) for p in patterns)


def rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES_FILE)["groups"] for rule in group["rules"]]


def dashboard(path: Path = DASHBOARD_FILE) -> dict[str, Any]:
    return json.loads(path.read_text())


def dashboard_queries(path: Path | None = None) -> list[str]:
    """The queries of the dashboard at ``path``; of every dashboard when None."""
    queries = []
    for board in [dashboard(path)] if path is not None else [dashboard(p) for p in DASHBOARD_FILES]:
        for panel in board["panels"]:
            queries.extend(t["expr"] for t in panel.get("targets", []))
    return queries


def all_queries() -> list[str]:
    return [*(rule["expr"] for rule in rules()), *dashboard_queries()]


# -- PromQL: which metric names and label names a query uses -------------------------------------------

_SELECTOR = re.compile(r"(?P<name>(?:flatfare_|vllm:)[A-Za-z0-9_:]*)\s*(?:\{(?P<matchers>[^}]*)\})?")
_MATCHER = re.compile(r"(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\((?P<labels>[^)]*)\)")


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """``(metric name, label names matched)`` for every Flatfare and vLLM metric in ``expr``."""
    return [(m["name"], {x["label"] for x in _MATCHER.finditer(m["matchers"] or "")})
            for m in _SELECTOR.finditer(expr)]


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for m in _GROUPING.finditer(expr) for label in m["labels"].split(",") if label.strip()}

