"""A test that cannot run here says so: skipped on a developer's machine, failed under CI (``CI`` set,
as .ci/run does), where everything the suite needs is installed. Every such skip goes through
tests/conftest.py's :func:`need` / :func:`unavailable`, so none can hide a broken CI install."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, need, unavailable

# A skip written any other way: pytest.skip(...), @pytest.mark.skip/skipif, pytest.importorskip(...).
DIRECT_SKIP = re.compile(r"pytest\.(skip\s*\(|mark\.skip|importorskip)")


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_a_missing_capability_is_skipped_locally(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        need(False, "no frobnicator")
    need(True, "never said")


def test_a_missing_capability_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    for say in (lambda: need(None, "no frobnicator"), lambda: unavailable("no frobnicator")):
        with pytest.raises(BaseException) as raised:  # a skip escaping here would only skip this test
            say()
        assert raised.type is pytest.fail.Exception, raised.type
        assert "no frobnicator" in str(raised.value) and "CI is set" in str(raised.value)
    need("/usr/bin/frobnicator", "never said")


def test_every_skip_goes_through_need() -> None:
    conftest = REPO / "tests" / "conftest.py"
    direct = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
              for path in sorted((REPO / "tests").rglob("*.py")) if path not in (conftest, Path(__file__).resolve())
              for number, line in enumerate(path.read_text().splitlines(), 1) if DIRECT_SKIP.search(line)]
    assert not direct, "skip through tests.conftest.need/unavailable (it fails under CI):\n" + "\n".join(direct)
