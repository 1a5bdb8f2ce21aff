"""Tables (Markdown + CSV, with the machine, versions and settings) and PNG plots for bench/results/."""

from __future__ import annotations

import csv
import datetime as dt
import importlib.metadata
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _git_commit() -> str:
    """HEAD, marked when the code measured (everything but bench/) had uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", ".", ":!bench"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{head} + uncommitted changes" if dirty else head


_COMMIT_AT_START: list[str] = []


def mark_start() -> None:
    """Remember the commit measured: a run takes minutes, and commits may land meanwhile."""
    _COMMIT_AT_START[:] = [_git_commit()]


def machine(extra_versions: dict[str, str] | None = None) -> dict[str, str]:
    info = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host cpu": f"{_cpu_model()}, {os.cpu_count()} cores",
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "flatfare commit": (f"{_COMMIT_AT_START[0]} at the start" if _COMMIT_AT_START else _git_commit()),
    }
    for dist in ("fastapi", "uvicorn", "redis", "sqlalchemy", "aiohttp"):
        info[dist] = _version(dist)
    info.update(extra_versions or {})
    return info


def gpu_name() -> str | None:
    """This machine's GPU as nvidia-smi names it (the first one), or None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    names = done.stdout.strip().splitlines()
    return names[0].strip() if names else None


def card_of(found: Iterable[Path]) -> str:
    """The GPU a device run used, from the ``nvidia-smi.csv`` it left beside its results (``name, driver,
    memory``, a header first) in any of ``found`` (files or folders) or their parents: every GPU table says
    which card it came from rather than assuming one."""
    cards = set()
    for path in found:
        for folder in (path, *path.parents) if path.is_dir() else path.parents:
            for csv_path in (folder / "nvidia-smi.csv", *sorted(folder.glob("*/nvidia-smi.csv"))):
                if csv_path.is_file():
                    lines = [line for line in csv_path.read_text().splitlines()[1:] if line.strip()]
                    cards.update(line.split(",")[0].strip() for line in lines)
            if cards:
                break
    return " / ".join(sorted(cards)) if cards else "the GPU (not recorded: no nvidia-smi.csv with the results)"


def load_average() -> str:
    """The 1/5/15-minute load averages: a busy neighbour on these 2-core VMs shows here."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(fmt(v, 2) if isinstance(v, float) else fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(rows)


def write_markdown(path: Path, title: str, intro: str, info: dict[str, str], settings: dict[str, Any],
                   sections: Sequence[tuple[str, str]]) -> None:
    parts = [f"# {title}", "", intro.strip(), "", "## Machine and versions", "",
             markdown_table(["what", "value"], list(info.items())), "", "## Settings", "",
             markdown_table(["setting", "value"], [(k, str(v)) for k, v in settings.items()]), ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body.strip(), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
               logy: bool = False, logx: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for label, (xs, ys) in series.items():
        pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pairs:
            ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
