"""Benchmark 3: Flatfare against ``vllm serve`` on the lent H200 (vLLM 0.26 there).

The device machine has no network and keeps ``/tmp`` only while it stays warm, so the run is three
steps (see docs/PERFORMANCE.md for the exact device calls):

1. ``python -m bench gpu prepare`` (here): Flatfare's own wheel, built offline from the checkout, the
   dependencies the device lacks, as cp312 ``--no-deps`` wheels, py-spy, and a ``redis-server`` with its
   two libraries, into ``.gpu_wheels/`` (git-ignored, ~22 MiB); the vLLM payload comes from
   ``shared/device/prepare_vllm_payload.sh``.
2. ``python -m bench gpu plan``: prints the device calls; each runs ``bench/gpu_device.sh`` there, which
   installs the wheels into ``/tmp/ffsite`` (Flatfare runs from its wheel, never from the source tree:
   ``flatfare.gateway`` and the rest exist only through the wheel's package-dir mapping), then runs
   ``python -m bench engine`` on the 8B or 1B shape (both systems, one server start each, repeated load
   runs against it) and leaves a ``.tgz`` per shape, and the 1B offline engine rate.
3. ``python -m bench gpu report DIR_OR_TGZ_OR_JSON ...`` (here): turns what came back into
   ``bench/results/engine_gpu-*.md/.csv/.png``, with the issue's goals beside the ratios.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import engine, report

WHEELS_DIR = report.REPO_ROOT / ".gpu_wheels"
# The LLaVA entry's extra wheels (VISION_WHEELS, 16 MiB), in a folder of their own: carried only for
# `gpu_device.sh capabilities`, so that .gpu_wheels (~26 MiB) fits a call beside the vLLM payload's last part.
VISION_DIR = report.REPO_ROOT / ".gpu_vision"
# bench/gpu_device.sh installs the one wheel in here (install-flatfare); the dependencies' wheels are in whl/.
FLATFARE_WHEEL_DIR = "flatfare"
# What Flatfare imports that the device image (Ubuntu 24.04, Python 3.12) lacks, or has too old; the
# versions are the ones Flatfare is tested with here. fastapi, starlette, uvicorn and pydantic come with
# the vLLM payload. httptools is what `pip install vllm` brings (through fastapi[standard]) and what
# uvicorn picks for both vllm serve and the gateway.
DEVICE_WHEELS = ["redis==8.1.0", "SQLAlchemy==2.1.9", "greenlet==3.5.6", "alembic==1.20.1", "Mako==1.4.3",
                 "MarkupSafe==3.0.4", "pydantic-settings==2.16.3", "python-dotenv==1.2.4", "aiosqlite==0.22.1",
                 "orjson==3.13.0", "httptools==0.9.0", "typer==0.29.2", "rich==15.0.0", "shellingham==1.5.4",
                 "annotated-doc==0.0.7", "markdown-it-py==4.3.0", "mdurl==0.1.2", "pygments==2.21.0",
                 "stripe==16.1.0", "python-json-logger==4.2.0", "prometheus-client==0.26.0",
                 "hiredis==3.5.0", "async-lru==2.4.0", "granian==2.8.9",
                 # The console's (gateway/console/): Argon2 hashes, email checks; cffi may be on the device already.
                 "argon2-cffi==25.1.0", "argon2-cffi-bindings==26.2.0", "cffi==2.1.1", "pycparser==3.12",
                 "email-validator==2.4.0", "dnspython==2.9.2", "python-multipart==0.0.34",
                 # Not Flatfare's: samples the worker during one extra 256-client run (gpu_device.sh PYSPY).
                 "py-spy==0.4.3",
                 # Not Flatfare's either: vLLM 0.26 imports compressed-tensors (its pin) for every quantization
                 # method, fp8 included, and the payload lacks it (gpu_device.sh capabilities: the fp8 entry).
                 "compressed-tensors==0.17.0", "loguru==0.7.3",
                 # vLLM 0.26 imports lm-format-enforcer to validate any structured output (forced tool calls, JSON
                 # schemas); the payload lacks it.
                 "lm-format-enforcer==0.11.3", "interegular==0.3.3", "pyyaml==6.0.4"]
# For the LLaVA entry of `gpu_device.sh capabilities` only, installed apart (vision/, on its path alone): vLLM's
# LLaVA imports mistral_common (through pixtral), and once it is importable transformers' MistralCommonBackend,
# which vLLM's guidance backend imports for every model, needs all of its dependencies (mistral_common 1.13.1
# carried alone broke every start). With these on every run's path the Llama tokenizer of `run` failed to
# load on both sides ("Couldn't instantiate the backend tokenizer").
VISION_WHEELS = ["mistral-common==1.11.7", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
                 "referencing==0.37.0", "rpds-py==2026.9.1", "attrs==26.1.0", "pydantic-extra-types==2.11.1",
                 "pycountry==26.2.16", "tiktoken==0.14.0"]
REDIS_LIBS = ("liblzf.so.1", "libjemalloc.so.2")


@dataclass(frozen=True)
class Goals:
    """The issue's goals for one shape, against ``vllm serve`` with the same engine options."""

    min_ratio: float  # Flatfare's output tok/s over vllm serve's (medians), at least,
    ratio_at: tuple[int, ...] = ()  # at these concurrencies (empty: at every one)
    ttft_c1_ms: float | None = None  # TTFT p50 at 1 client at most this many ms above vllm serve's
    offline_share: float | None = None  # Flatfare's best output tok/s over the offline engine's, at least


GOALS = {"8b": Goals(1.00, ttft_c1_ms=5.0), "1b": Goals(1.30, ratio_at=(64, 256), offline_share=0.80)}
# `vllm_bench.py offline` on the same machine kind (shared/device/README.md, 2026-12-02): what the GPU
# does with no server in front, quoted when a session did not measure it itself.
OFFLINE_REFERENCE = {"1b": [22158.0, 22802.0], "8b": [7068.0, 7169.0]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gpu_command", required=True)
    sub.add_parser("prepare", help="build Flatfare's wheel, download the device wheels and redis-server into "
                   ".gpu_wheels/")
    sub.add_parser("plan", help="print the device calls to make")
    rep = sub.add_parser("report", help="turn fetched result folders or .tgz files into tables and plots")
    rep.add_argument("paths", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def _package_folders(setuptools: dict[str, Any]) -> set[str]:
    """The checkout's top-level folders that hold the wheel's packages, pyproject's package-dir mapping
    applied (flatfare.gateway comes from gateway/)."""
    mapping = setuptools.get("package-dir", {})
    folders = set()
    for package in setuptools["packages"]:
        parent = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len, default=None)
        folders.add(mapping[parent].split("/")[0] if parent else package.split(".")[0])
    return folders


def build_flatfare_wheel(out: Path) -> Path:
    """Flatfare's own wheel, built offline as tests/deploy/test_wheel.py and the images build it: from a clean
    copy of what the build backend reads (a checkout's stale build/ could add files), with ``pip wheel
    --no-deps --no-build-isolation`` (setuptools comes with the test extra)."""
    project = tomllib.loads((report.REPO_ROOT / "pyproject.toml").read_text())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        for name in ("pyproject.toml", project["project"]["readme"]):
            shutil.copy2(report.REPO_ROOT / name, source / name)
        for folder in sorted(_package_folders(project["tool"]["setuptools"])):
            shutil.copytree(report.REPO_ROOT / folder, source / folder,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                               "--no-build-isolation", "--check-build-dependencies", "--wheel-dir", tmp, str(source)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip wheel could not build Flatfare's wheel:\n{done.stdout}{done.stderr}")
        (built,) = Path(tmp).glob("flatfare-*.whl")
        for old in out.glob("flatfare-*.whl"):
            old.unlink()
        return Path(shutil.copy2(built, out / built.name))


def prepare() -> int:
    whl = WHEELS_DIR / "whl"
    shutil.rmtree(WHEELS_DIR, ignore_errors=True)
    shutil.rmtree(VISION_DIR, ignore_errors=True)
    whl.mkdir(parents=True)
    wheel = build_flatfare_wheel(WHEELS_DIR / FLATFARE_WHEEL_DIR)
    for folder, wheels in ((whl, DEVICE_WHEELS), (VISION_DIR, VISION_WHEELS)):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                        "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                        "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(folder), *wheels],
                       check=True)
    server = shutil.which("redis-server")
    if server is None:
        print("need a redis-server here to carry (apt-get install redis-server)", file=sys.stderr)
        return 2
    redis_dir = WHEELS_DIR / "redis"
    (redis_dir / "lib").mkdir(parents=True)
    shutil.copy2(server, redis_dir / "redis-server")
    ldd = subprocess.run(["ldd", server], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        parts = line.split()
        if parts and parts[0] in REDIS_LIBS and "=>" in parts:
            shutil.copy2(Path(parts[parts.index("=>") + 1]).resolve(), redis_dir / "lib" / parts[0])
    size = sum(f.stat().st_size for f in WHEELS_DIR.rglob("*") if f.is_file()) / 2**20
    print(f"[gpu] {wheel.name}, {len(list(whl.glob('*.whl')))} dependency wheels and redis-server in {WHEELS_DIR} "
          f"({size:.1f} MiB)")
    return 0


PLAN = """\
Device calls (the `run` tool; either card), back to back: an idle machine is given back after ~30 s, /tmp
with it. Each call's carried folders plus the working tree stay under 64 MiB: the vLLM payload comes in
three parts (part1 and part2 36 MiB, part3 19 MiB), .gpu_wheels is ~25 MiB (the LLaVA entry's wheels are
apart, in .gpu_vision, carried for `capabilities` only) and the tracked tree ~10 MiB; `du -sh` them before
a call. First, here: build the vLLM payload (shared/device/prepare_vllm_payload.sh .gpu_vllm, with
shared/device/* copied to .gpu_tools/ as its README says) and run `python -m bench gpu prepare` (.gpu_wheels:
the dependencies' wheels and Flatfare's own, built from this checkout's files: run it again after changing
Flatfare's code). Carried folders stay on the warm machine between calls.
Each command is one line. END_BY is when the call must be done: gpu_device.sh stops bench.engine 50 s
before it (SIGINT: servers stopped, what was measured written) and still leaves its .tgz. Only .tgz, .json
and .log files are left in $OUT (at most 8 files come back).

1. (~1-2 min with the cold start)  timeout_s: 120   carry: [".gpu_vllm/part1", ".gpu_tools"]
bash .gpu_tools/device_setup.sh stash .gpu_vllm/part1

2. (~20 s)  timeout_s: 120   carry: [".gpu_vllm/part2", ".gpu_tools"]
bash .gpu_tools/device_setup.sh stash .gpu_vllm/part2

3. (~8-8.5 min)  timeout_s: 600   carry: [".gpu_vllm/part3", ".gpu_tools", ".gpu_wheels"]
export END_BY=$(($(date +%s)+585)); bash .gpu_tools/device_setup.sh install .gpu_vllm/part3 > $OUT/setup.log 2>&1 && bash bench/gpu_device.sh setup >> $OUT/setup.log 2>&1 || { tail -30 $OUT/setup.log; exit 1; }; tail -3 $OUT/setup.log; GATEWAY_PROCESSES=4 REPEATS=3 PYSPY=15 REQUESTS="8 64 256 512" TAG_SUFFIX=-s4 bash bench/gpu_device.sh run 8b 1 $OUT/gpu_8b

   Setup ~50 s: the wheels go into /tmp/ffsite with --no-deps (Flatfare's as an installed package: the
   source tree is never on PYTHONPATH, bench/ alone is, through /tmp/ffbench); it checks that flatfare,
   flatfare.migrations, .gateway.app, .workers.main and .workers.engine import from /tmp/ffsite, even in
   the checkout's root, and that `flatfare migrate` brings a scratch SQLite file to head.
   Then 8B: vllm serve, then Flatfare, one start each (~105-125 s), 3 repeats of concurrency
   1 16 64 256 (~30 s a repeat with these REQUESTS; 10 96 500 500 would be ~40 s and not fit), then one
   uncounted 256-client Flatfare run under py-spy (cut first if time runs short). ~440 s of bench.engine.

4. (~7.5 min)  timeout_s: 600   carry: [".gpu_tools"]
export END_BY=$(($(date +%s)+585)); GATEWAY_PROCESSES=4 REPEATS=3 PYSPY=15 TAG_SUFFIX=-s4 bash bench/gpu_device.sh run 1b 1 $OUT/gpu_1b; bash bench/gpu_device.sh offline 1b $OUT/offline_1b

   1B, the same with REQUESTS 10 96 500 500 (~20 s a repeat, ~80 s a start; ~350 s), then
   vllm_bench.py offline (~90 s) if at least 120 s are left before END_BY, else it says "offline skipped":

5. (only after "offline skipped"; ~2 min)  timeout_s: 300   carry: [".gpu_tools"]
export END_BY=$(($(date +%s)+280)); bash bench/gpu_device.sh offline 1b $OUT/offline_1b

Knobs of gpu_device.sh run (environment): REQUESTS (one per concurrency 1 16 64 256; 10 96 500 500),
REPEATS (load runs per point per server start; 3), GATEWAY_PROCESSES (4), PYSPY=SECONDS (py-spy on the
worker during one extra, uncounted run at 256 clients), ORDER=flatfare-first, SYSTEMS="flatfare",
TAG_SUFFIX, ENGINE_OPTIONS (JSON given to both systems; {"load_format": "dummy"}), VIA_CATALOG=1 (Flatfare's
worker takes them from a catalog entry, validated as the admin API does), CONCURRENCY (1 16 64 256),
END_BY (epoch seconds).

Capabilities (issue 20): `bash bench/gpu_device.sh capabilities $OUT/caps` runs `python -m bench capabilities`
on random-weight Qwen3-8B (two entries: hermes + deepseek_r1, hermes alone) and LLaVA-1.5-7B shapes, each
from a catalog entry, and leaves caps.tgz (one JSON per entry); fp8 and n-gram speculation against vllm serve:
VIA_CATALOG=1 ENGINE_OPTIONS='{"load_format": "dummy", "quantization": "fp8"}' TAG_SUFFIX=-fp8 ... run 8b 1 DIR.
Then, here: python -m bench gpu report <files_at>/gpu_8b.tgz <files_at>/gpu_1b.tgz <files_at>/offline_1b.json
(writes bench/results/engine_gpu-8b-s4.md and engine_gpu-1b-s4.md, with the goals beside the ratios).

The rehearsal (issue 32, ~16 min of the device in all): calls 1 and 2 as above, then
3'. (~10 min)  timeout_s: 600   carry: [".gpu_vllm/part3", ".gpu_tools", ".gpu_wheels"]
bash .gpu_tools/device_setup.sh install .gpu_vllm/part3 > $OUT/setup.log 2>&1 && bash bench/gpu_device.sh setup >> $OUT/setup.log 2>&1 || { tail -30 $OUT/setup.log; exit 1; }; bash bench/gpu_device.sh rehearsal start /tmp/rh; bash bench/gpu_device.sh rehearsal wait /tmp/rh 480
4'. and on, each at once after the last (~10 min)  timeout_s: 600   carry: []
bash bench/gpu_device.sh rehearsal wait /tmp/rh 570
   until it says "rehearsal done"; each call brings $OUT/rehearsal.tgz (flatfare.json, vllm.json, the logs).
Then, here: python -m bench rehearsal report <files_at>/rehearsal/flatfare.json <files_at>/rehearsal/vllm.json
(writes bench/results/rehearsal_gpu.md, .csv and the plots).
"""


def _find(paths: list[Path], scratch: Path) -> tuple[list[Path], list[Path]]:
    """The points files and the offline results among ``paths`` (files, folders, .tgz)."""
    points: list[Path] = []
    offline: list[Path] = []
    for index, path in enumerate(paths):
        if path.suffix == ".tgz" or path.name.endswith(".tar.gz"):
            target = scratch / f"{index}_{path.name.split('.')[0]}"  # two calls' gpu_8b.tgz stay apart
            with tarfile.open(path) as archive:
                archive.extractall(target, filter="data")
            path = target
        if path.is_file():
            (offline if path.name.startswith("offline_") else points).append(path)
            continue
        points += sorted(path.rglob("engine_gpu-*_points.json"))
        offline += sorted(path.rglob("offline_*.json"))
    return points, offline


def _offline_rates(files: list[Path]) -> dict[str, list[float]]:
    """Output tok/s of each timed run of ``vllm_bench.py offline``, by shape (``offline_1b.json``: 1b)."""
    rates: dict[str, list[float]] = {}
    for path in files:
        shape = path.stem.removeprefix("offline_").split("_")[0]
        try:
            runs = json.loads(path.read_text())["runs"]
        except (ValueError, KeyError) as exc:
            print(f"[gpu] {path.name}: no offline runs ({exc})", file=sys.stderr)
            continue
        rates.setdefault(shape, []).extend(float(r["output_tok_per_s"]) for r in runs)
    return rates


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("**met**" if ok else "**not met**")


def goals_section(shape: str, points: list[dict[str, Any]], offline: list[float] | None,
                  offline_source: str) -> tuple[str, str]:
    """The table the issue asks for: Flatfare / vLLM per concurrency (median, and the widest the runs
    allow), TTFT at 1 client, and (1B) Flatfare's rate as a share of the offline engine's."""
    goals = GOALS.get(shape, Goals(1.0))
    rows = engine.summarize(points)
    by = {(r["system"], r["concurrency"]): r for r in rows}
    rats = {r["concurrency"]: r for r in engine.ratios(rows)}
    offline_rate = report.median(offline) if offline else None
    columns = ["concurrency", "vLLM direct tok/s", "Flatfare tok/s", "Flatfare / vLLM (runs' range)", "goal",
               "TTFT p50 vLLM / Flatfare, ms (diff)"]
    if offline_rate:
        columns.append("Flatfare / offline")
    cells = []
    ratio_ok: list[bool] = []
    for conc in sorted({r["concurrency"] for r in rows}):
        v, f, rat = by.get(("vllm", conc)), by.get(("flatfare", conc)), rats.get(conc)
        judged = not goals.ratio_at or conc in goals.ratio_at
        ok = None if rat is None or not judged else rat["tok_s_ratio"] >= goals.min_ratio
        if ok is not None:
            ratio_ok.append(ok)
        ratio = "-" if rat is None else (f"{report.fmt(rat['tok_s_ratio'], 2)} ({report.fmt(rat['tok_s_ratio_min'], 2)}"
                                         f"-{report.fmt(rat['tok_s_ratio_max'], 2)})")
        ttft = (f"{report.fmt(v['ttft_p50_ms'])} / {report.fmt(f['ttft_p50_ms'])} "
                f"({f['ttft_p50_ms'] - v['ttft_p50_ms']:+.1f})" if v and f and v["ttft_p50_ms"] is not None
                and f["ttft_p50_ms"] is not None else "-")
        row = [conc, engine.spread(v, "output_tok_per_s") if v else "-",
               engine.spread(f, "output_tok_per_s") if f else "-", ratio,
               f">= {goals.min_ratio:.2f}: {_verdict(ok)}" if judged else "-", ttft]
        if offline_rate:
            row.append(report.fmt(f["output_tok_per_s"] / offline_rate, 2) if f else "-")
        cells.append(row)
    lines = [report.markdown_table(columns, cells), ""]
    judged_at = "at " + ", ".join(map(str, goals.ratio_at)) if goals.ratio_at else "at every concurrency"
    lines.append(f"- Output tok/s, Flatfare / vLLM direct >= {goals.min_ratio:.2f} {judged_at}: "
                 f"{_verdict(all(ratio_ok) if ratio_ok else None)} (met at {sum(ratio_ok)} of {len(ratio_ok)}).")
    if goals.ttft_c1_ms is not None:
        v, f = by.get(("vllm", 1)), by.get(("flatfare", 1))
        diff = None if not (v and f) or None in (v["ttft_p50_ms"], f["ttft_p50_ms"]) \
            else f["ttft_p50_ms"] - v["ttft_p50_ms"]
        lines.append(f"- TTFT p50 at 1 client within +{goals.ttft_c1_ms:g} ms of vLLM direct: "
                     f"{'-' if diff is None else f'{diff:+.1f} ms'}, "
                     f"{_verdict(None if diff is None else diff <= goals.ttft_c1_ms)}.")
    flatfare = [r for r in rows if r["system"] == "flatfare" and r["output_tok_per_s"] is not None]
    if offline_rate and flatfare:
        best = max(flatfare, key=lambda r: r["output_tok_per_s"])
        share = best["output_tok_per_s"] / offline_rate
        goal = (f" (goal >= {goals.offline_share:.2f}: {_verdict(share >= goals.offline_share)})"
                if goals.offline_share is not None else "")
        lines.append(f"- Offline engine (`vllm_bench.py offline`: vllm.LLM, 512 prompts of 512 random tokens, 128 out, "
                     f"ignore_eos), {offline_source}: {report.fmt(offline_rate)} output tok/s (runs: "
                     f"{' / '.join(report.fmt(x) for x in offline)}). Flatfare's best median, at "
                     f"{best['concurrency']} clients: {report.fmt(best['output_tok_per_s'])} tok/s = "
                     f"{share:.2f} of it{goal}.")
    elif goals.offline_share is not None:
        lines.append(f"- Flatfare >= {goals.offline_share:.2f} of the offline engine's rate: no offline figure.")
    return "Against the goals (medians over all runs; range: Flatfare's worst / vLLM's best to the reverse)", \
        "\n".join(lines)


def pyspy_sections(files: list[Path]) -> list[tuple[str, str]]:
    """What py-spy saw in the worker during the extra run: the GIL's busy share and where its time went."""
    from bench.profile import analyse  # the same analysis as `python -m bench profile`

    sections = []
    for path in files:
        summary = json.loads(path.read_text())
        run = summary.get("run") or {}
        busy = report.fmt(summary.get("worker_gil_busy_share"), 2)
        lines = [(f"One extra run (not counted) at {summary['concurrency']} clients, {summary['requests']} requests: "
                  f"{report.fmt(run.get('output_tok_per_s'))} tok/s; py-spy --nonblocking, {summary['rate']} Hz for "
                  f"{summary['seconds']} s on the worker (pid {summary['worker_pid']})."),
                 (f"- The worker held the GIL in {busy} of the sampling time (samples / rate x seconds; near 1.00: "
                  "the worker's Python loop is the bottleneck)."),
                 (f"- CPU in the run: worker (with vLLM's engine core) {report.fmt(run.get('worker_cpu_s'))} s, gateway "
                  f"processes {report.fmt(run.get('gateway_cpu_s'))} s, over {report.fmt(run.get('elapsed_s'))} s.")]
        for proc, count in (summary.get("worker", {}).get("samples_by_process") or {}).items():
            lines.append(f"- Active samples, {proc.replace('|', '/')}: {count}")
        gil = path.with_name(path.stem + "_worker-gil.txt.gz")
        if gil.exists():
            with gzip.open(gil, "rt") as handle:
                total, own, _, packages = analyse(handle.read(), top=12)
            if total:
                table = [(name.replace("|", "\\|"), f"{100 * n / total:.1f} %") for name, n in own]
                lines += ["", "GIL holder, own time by function:", "",
                          report.markdown_table(["function", "share"], table), "", "By package:", "",
                          report.markdown_table(["package", "share"], [(n, f"{100 * c / total:.1f} %")
                                                                      for n, c in packages])]
        sections.append((f"Worker profile ({path.stem.split('_pyspy_')[0].removeprefix('engine_')})", "\n".join(lines)))
    return sections


def _device_date(md: Path) -> str | None:
    match = re.search(r"^\| date \| ([^|]+) \|", md.read_text(), re.MULTILINE) if md.exists() else None
    return match.group(1).strip() if match else None


def report_results(paths: list[Path], out: Path) -> int:
    by_shape: dict[str, list[dict]] = {}
    tags: dict[str, set[str]] = {}
    sources: dict[str, list[str]] = {}
    profiles: dict[str, list[Path]] = {}
    dates: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        files, offline_files = _find(paths, Path(tmp))
        offline = _offline_rates(offline_files)
        if not files:
            print("no engine_gpu-*_points.json found", file=sys.stderr)
            return 2
        for points_file in files:
            tag = points_file.name.removeprefix("engine_").removesuffix("_points.json")
            shape = tag.split("-")[1]  # gpu-8b-r2 -> 8b
            points = json.loads(points_file.read_text())
            failed = [p for p in points if not p["completed"]]
            if failed:  # a system that never answered (see its logs), not a zero-throughput measurement
                print(f"[gpu] {points_file.name}: dropping {len(failed)} runs of "
                      f"{sorted({p['system'] for p in failed})} that completed no request")
                points = [p for p in points if p["completed"]]
            session = tag.removeprefix(f"gpu-{shape}") or "-s1"
            for p in points:
                p["round"] = f"{session.lstrip('-')}.{p['round']}"
            by_shape.setdefault(shape, []).extend(points)
            tags.setdefault(shape, set()).add(tag)
            # The folder the device wrote (gpu_8b/raw/engine_..._points.json: gpu_8b).
            where = points_file.parent.parent if points_file.parent.name == "raw" else points_file.parent
            sources.setdefault(shape, []).append(where.name)
            raw_dir = points_file.parent
            md = raw_dir.parent / f"engine_{tag}.md"
            keep = out / "raw" / f"engine_{tag}"
            keep.mkdir(parents=True, exist_ok=True)
            for extra in [md, raw_dir.parent / "nvidia-smi.csv", *sorted(raw_dir.glob(f"engine_{tag}_pyspy_*"))]:
                if extra.exists():
                    shutil.copy2(extra, keep / extra.name)
            if (date := _device_date(md)) is not None:
                dates.add(date)
            profiles.setdefault(shape, []).extend(sorted(keep.glob(f"engine_{tag}_pyspy_r*[0-9].json")))
            logs = raw_dir / f"engine_{tag}_logs"
            if logs.exists():
                for log in logs.iterdir():
                    shutil.copy2(log, keep / log.name)
            shutil.copy2(points_file, out / "raw" / points_file.name)
        for path in offline_files:
            shutil.copy2(path, out / "raw" / path.name)
    card = report.card_of([out / "raw" / f"engine_{t}" for ts in tags.values() for t in ts])
    device_info = {"device": f"{card} (device tool), 1 GPU, 16 CPU cores; vLLM 0.26.0, torch 2.11.0+cu130",
                   "date": ", ".join(sorted(dates)) or report.machine()["date"],
                   "flatfare commit": report.machine()["flatfare commit"]}
    for shape, points in by_shape.items():
        # One session's tag names the files (engine_gpu-8b-s4.md); several sessions merge into engine_gpu-8b.md.
        tag = next(iter(tags[shape])) if len(tags[shape]) == 1 else f"gpu-{shape}"
        runs: dict[str, set[int]] = {}
        for p in points:
            runs.setdefault(p["round"], set()).add(p.get("repeat", 0))
        requests = sorted({(p["concurrency"], p["requests"]) for p in points if "requests" in p})
        gateways = sorted({str(p.get("gateway_processes", "not recorded")) for p in points if p["system"] == "flatfare"})
        options = sorted({p["engine_options"] for p in points if "engine_options" in p})
        measured = offline.get(shape)
        reference = measured or (OFFLINE_REFERENCE.get(shape) if GOALS.get(shape, Goals(1.0)).offline_share else None)
        source = "measured in this session" if measured else "not measured here: the 2026-12-02 reference run of " \
                 "shared/device/README.md, same machine kind"
        settings = {"model": f"Llama-{shape.upper()} shape, random weights (--load-format dummy), SmolLM2 vocab",
                    "engine options (both)": (", ".join(options) if options else '{"load_format": "dummy"}') +
                    " + vLLM 0.26 defaults (bf16, compile, CUDA graphs, prefix caching, chunked prefill)",
                    "input / output tokens": "512 / 128 (ignore_eos, random token ids, fresh per run)",
                    "concurrency: requests": ", ".join(f"{c}: {n}" for c, n in requests) or
                    "not recorded (1: 10, 16: 96, 64: 500, 256: 500 in the first sessions)",
                    "runs (device session.round: repeats on one server start)":
                    ", ".join(f"{r}: {len(reps)}" for r, reps in sorted(runs.items())),
                    "client": "bench.loadgen, streaming /v1/completions, on the device",
                    "gateway processes (Flatfare)": ", ".join(gateways) or "-",
                    "results from": ", ".join(sources[shape])}
        if shape in offline:
            settings["offline engine runs (output tok/s)"] = " / ".join(report.fmt(x) for x in offline[shape])
        sections = [goals_section(shape, points, reference, source), *pyspy_sections(profiles.get(shape, []))]
        engine.write_results(out, tag, f"GPU {shape.upper()}: Flatfare against vllm serve on {card}",
                             points, device_info, settings, sections=sections)
        print(f"[gpu] wrote {out / f'engine_{tag}.md'} ({len(points)} runs)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.gpu_command == "prepare":
        return prepare()
    if args.gpu_command == "plan":
        print(PLAN)
        return 0
    return report_results(args.paths, args.out)
