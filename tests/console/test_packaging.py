"""Every template and static file of the console is named by pyproject's package-data, so the wheel (and
the images built from it) serve the same pages as a checkout. tests/deploy/test_wheel.py builds and
runs the wheel; this says which file would be missing, in a fraction of a second."""

from __future__ import annotations

import tomllib
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
CONSOLE = REPO / "gateway" / "console"


def test_every_console_asset_is_package_data() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "flatfare.gateway.console" in config["tool"]["setuptools"]["packages"]
    globs = config["tool"]["setuptools"]["package-data"]["flatfare.gateway.console"]
    assets = [PurePosixPath(p.relative_to(CONSOLE).as_posix()) for p in CONSOLE.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert any(a.name == "htmx.min.js" for a in assets) and any(a.name == "base.html" for a in assets)
    # PurePath.match anchors a pattern with a slash at the start when it is absolute only; a relative
    # pattern matches from the right, so compare part counts too (templates/*.html must not match a/templates/x.html).
    missing = [str(a) for a in assets
               if not any(a.match(g) and len(a.parts) == len(PurePosixPath(g).parts) for g in globs)]
    assert not missing, f"not in pyproject's package-data for flatfare.gateway.console: {missing}"
