"""Benchmark 3: Flatfare against ``vllm serve`` on the lent H200 (vLLM 0.26 there).

The device machine has no network and keeps ``/tmp`` only while it stays warm, so the run is three
steps (see docs/PERFORMANCE.md for the exact device calls):

1. ``python -m bench gpu prepare`` (here): Flatfare's own dependencies the device lacks, as cp312
   ``--no-deps`` wheels, and a ``redis-server`` with its two libraries, into ``.gpu_wheels/``
   (git-ignored, ~8 MB); the vLLM payload comes from ``shared/device/prepare_vllm_payload.sh``.
2. ``python -m bench gpu plan``: prints the device calls; each runs ``bench/gpu_device.sh`` there,
   which runs ``python -m bench engine`` on the 8B and 1B shapes and leaves a ``.tgz`` per shape.
3. ``python -m bench gpu report DIR_OR_TGZ ...`` (here): turns what came back into
   ``bench/results/engine_gpu-*.md/.csv/.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench import engine, report

WHEELS_DIR = report.REPO_ROOT / ".gpu_wheels"
# What Flatfare imports that the device image (Ubuntu 24.04, Python 3.12) lacks, or has too old; the
# versions are the ones Flatfare is tested with here. fastapi, starlette, uvicorn and pydantic come with
# the vLLM payload. httptools is what `pip install vllm` brings (through fastapi[standard]) and what
# uvicorn picks for both vllm serve and the gateway.
DEVICE_WHEELS = ["redis==8.1.0", "SQLAlchemy==2.1.9", "greenlet==3.5.6", "alembic==1.20.1", "Mako==1.4.3",
                 "MarkupSafe==3.0.4", "pydantic-settings==2.16.3", "python-dotenv==1.2.4", "aiosqlite==0.22.1",
                 "orjson==3.13.0", "httptools==0.9.0", "typer==0.29.2", "rich==15.0.0", "shellingham==1.5.4",
                 "annotated-doc==0.0.7", "markdown-it-py==4.3.0", "mdurl==0.1.2", "pygments==2.21.0",
                 "stripe==16.1.0", "python-json-logger==4.2.0", "prometheus-client==0.26.0"]
REDIS_LIBS = ("liblzf.so.1", "libjemalloc.so.2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gpu_command", required=True)
    sub.add_parser("prepare", help="download the device wheels and redis-server into .gpu_wheels/")
    sub.add_parser("plan", help="print the device calls to make")
    rep = sub.add_parser("report", help="turn fetched result folders or .tgz files into tables and plots")
    rep.add_argument("paths", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, default=report.RESULTS_DIR)


def prepare() -> int:
    whl = WHEELS_DIR / "whl"
    shutil.rmtree(WHEELS_DIR, ignore_errors=True)
    whl.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                    "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(whl), *DEVICE_WHEELS],
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
    print(f"[gpu] {len(list(whl.glob('*.whl')))} wheels and redis-server in {WHEELS_DIR} ({size:.1f} MiB)")
    return 0


PLAN = """\
Device calls (the `run` tool), back to back (an idle machine is given back after ~30 s, /tmp with it);
each call's carried folders plus the working tree stay under 64 MiB. First, here: build the vLLM
payload (shared/device/prepare_vllm_payload.sh .gpu_vllm, with shared/device/* copied to .gpu_tools/
as its README says) and run `python -m bench gpu prepare`.

1. command: bash .gpu_tools/device_setup.sh stash .gpu_vllm/part1
   carry: [".gpu_vllm/part1", ".gpu_tools"]                         timeout_s: 120
2. command: set -o pipefail; bash .gpu_tools/device_setup.sh install .gpu_vllm/part2 > $OUT/setup.log 2>&1 \
              || { tail -20 $OUT/setup.log; exit 1; }; bash bench/gpu_device.sh setup && \
              ORDER=flatfare-first TAG_SUFFIX=-s2 timeout 560 bash bench/gpu_device.sh run 8b 1 $OUT/gpu_8b_s2
   carry: [".gpu_vllm/part2", ".gpu_tools", ".gpu_wheels"]          timeout_s: 600   (~6 min: 8B, both systems)
3. (optional, same machine) the 1B shape, which is CPU-bound when served, with repeats:
   command: timeout 560 bash bench/gpu_device.sh run 1b 2 $OUT/gpu_1b
   carry: [".gpu_tools", ".gpu_wheels"]                              timeout_s: 600
   Environment knobs of gpu_device.sh run: ORDER=flatfare-first, SYSTEMS="flatfare", TAG_SUFFIX=-x,
   REQUESTS="10 96 500 500", GATEWAY_PROCESSES=N, ENGINE_OPTIONS='{"load_format": "dummy",
   "max_num_batched_tokens": 8192, "max_num_seqs": 1024}' (vllm serve's own defaults on an H200, given
   to both: what the embedded worker gets once it asks for the API server's defaults).
Then: python -m bench gpu report <files_at>/gpu_8b_s2.tgz [more .tgz ...]
"""


def _points_files(paths: list[Path], scratch: Path) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.suffix == ".tgz" or path.name.endswith(".tar.gz"):
            target = scratch / path.stem
            with tarfile.open(path) as archive:
                archive.extractall(target, filter="data")
            path = target
        found += sorted(path.rglob("engine_gpu-*_points.json"))
    return found


def report_results(paths: list[Path], out: Path) -> int:
    by_shape: dict[str, list[dict]] = {}
    sources: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = _points_files(paths, Path(tmp))
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
            sources.setdefault(shape, []).append(points_file.parent.name)
            logs = points_file.parent / f"engine_{tag}_logs"
            md = points_file.parent.parent / f"engine_{tag}.md"
            keep = out / "raw" / f"engine_{tag}"
            keep.mkdir(parents=True, exist_ok=True)
            if md.exists():
                shutil.copy2(md, keep / md.name)
            smi = points_file.parent.parent / "nvidia-smi.csv"
            if smi.exists():
                shutil.copy2(smi, keep / smi.name)
            if logs.exists():
                for log in logs.iterdir():
                    shutil.copy2(log, keep / log.name)
            shutil.copy2(points_file, out / "raw" / points_file.name)
    device_info = {"device": "nvidia-h200 (device tool), 1 x H200, 16 CPU cores; vLLM 0.26.0, torch 2.11.0+cu130",
                   "date": report.machine()["date"], "flatfare commit": report.machine()["flatfare commit"]}
    for shape, points in by_shape.items():
        rounds = sorted({p["round"] for p in points})
        settings = {"model": f"Llama-{shape.upper()} shape, random weights (--load-format dummy), SmolLM2 vocab",
                    "engine options (both)": '{"load_format": "dummy"} + vLLM 0.26 defaults (bf16, compile, '
                    'CUDA graphs, prefix caching, chunked prefill)',
                    "input / output tokens": "512 / 128 (ignore_eos, random token ids, fresh per run)",
                    "concurrency: requests": "1: 10, 16: 96, 64: 500, 256: 500",
                    "runs (device session.round)": ", ".join(rounds), "client": "bench.loadgen, streaming "
                    "/v1/completions, on the device", "gateway processes": 1, "results from": ", ".join(sources[shape])}
        engine.write_results(out, f"gpu-{shape}", f"GPU {shape.upper()}: Flatfare against vllm serve on an H200",
                             points, device_info, settings)
        print(f"[gpu] wrote {out / f'engine_gpu-{shape}.md'} ({len(points)} runs)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.gpu_command == "prepare":
        return prepare()
    if args.gpu_command == "plan":
        print(PLAN)
        return 0
    return report_results(args.paths, args.out)
