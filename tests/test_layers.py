"""The import rules hold: import-linter's contracts in pyproject.toml ([tool.importlinter]), and no bare
`gateway` / `workers` / `billing` import anywhere (they exist only as flatfare.gateway, ...)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# The top-level folders that install under flatfare (pyproject's package-dir); importable only as flatfare.X.
BARE = frozenset({"gateway", "workers", "billing", "fleet"})
SCANNED = ("flatfare", "gateway", "workers", "billing", "fleet", "migrations", "bench", "tests")


def installed_layout(into: Path) -> Path:
    """Lay the package out as it installs: flatfare/ with gateway/, workers/, ... inside it (as links).

    grimp, import-linter's graph builder, walks only the folder of the root package, so in the checkout
    it would see flatfare/ alone and none of the folders that pyproject's package-dir maps into it.
    """
    package = into / "flatfare"
    package.mkdir()
    for entry in (REPO / "flatfare").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in mapped.items():
        parent, _, child = name.rpartition(".")
        assert parent == "flatfare", f"package-dir maps {name}: this layout handles flatfare.<name> only"
        (package / child).symlink_to(REPO / folder)
    return into


def test_import_contracts_hold(tmp_path: Path) -> None:
    root = installed_layout(tmp_path)
    # cwd and PYTHONPATH: the laid-out flatfare is found before the editable install's.
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(REPO / "pyproject.toml")],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"


def python_files() -> Iterator[Path]:
    for top in SCANNED:
        for folder, dirs, files in os.walk(REPO / top):
            # Hidden folders hold virtual environments (bench/.venv-litellm) and caches, not our code.
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            yield from (Path(folder) / name for name in files if name.endswith(".py"))


def bare_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) for each import that names gateway, workers or billing as a top-level package."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        yield from ((node.lineno, name) for name in names if name.partition(".")[0] in BARE)


def test_bare_imports_finder_catches_each_form() -> None:
    source = ("import gateway\nimport workers.loop as w\nfrom billing import quota\nfrom gateway.app import x\n"
              "importlib.import_module('workers.engine')\n"
              "import flatfare.gateway\nfrom flatfare.billing import quota\nfrom . import billing\n"
              "from .workers import loop\nimport gateways\n")
    assert [line for line, _ in bare_imports(source)] == [1, 2, 3, 4, 5]


def test_no_bare_top_level_imports() -> None:
    found = [f"{path.relative_to(REPO)}:{line}: {name}"
             for path in python_files() for line, name in bare_imports(path.read_text(encoding="utf-8"))]
    assert not found, "import these as flatfare.gateway / flatfare.workers / flatfare.billing:\n" + "\n".join(found)


if __name__ == "__main__":
    # `python tests/test_layers.py`: lint-imports on the installed layout, its report printed as is.
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        laid_out = installed_layout(Path(scratch))
        sys.exit(subprocess.run([str(LINT_IMPORTS), "--no-cache", str(REPO / "pyproject.toml")], cwd=laid_out,
                                env={**os.environ, "PYTHONPATH": str(laid_out)}).returncode)
