#!/usr/bin/env bash
# Runs ON THE DEVICE MACHINE (the device tool's `run`), from the checkout's root, after
# `.gpu_tools/device_setup.sh install` (vLLM 0.26 in /tmp/site, /tmp/vllm_env.sh written).
#
#   bash bench/gpu_device.sh setup                 # Flatfare's wheel, its deps, py-spy (.gpu_wheels) into /tmp/ffsite
#   bash bench/gpu_device.sh install-flatfare      # only Flatfare's wheel and bench's link, then check-flatfare
#   bash bench/gpu_device.sh check-flatfare        # flatfare imports from /tmp/ffsite; `flatfare migrate` works
#   bash bench/gpu_device.sh python ARGS...        # python3 as `run` starts bench.engine: its path, the root
#   bash bench/gpu_device.sh run SHAPE ROUNDS DIR  # SHAPE 8b|1b: make the model, run bench.engine, leave DIR.tgz
#   bash bench/gpu_device.sh offline SHAPE DIR     # vllm_bench.py offline on that model: DIR.json, DIR.log
#   bash bench/gpu_device.sh capabilities DIR      # bench.capabilities: tools, reasoning, vision via catalog entries
#   bash bench/gpu_device.sh fleet PART DIR        # bench.fleet gpu: PART levels (1B, real weights) | many (8B x6)
#   bash bench/gpu_device.sh rehearsal start DIR   # bench.rehearsal in the background: Flatfare, then vllm serve
#   bash bench/gpu_device.sh rehearsal wait DIR S  # follow it for up to S seconds; pack DIR into $OUT/rehearsal.tgz
#
# `run` compares Flatfare (private Redis, SQLite, flatfare worker + gateway) with `vllm serve` on a
# random-weight Llama of that shape (--load-format dummy), input 512 / output 128, ignore_eos,
# concurrency 1 16 64 256, one system at a time: ROUNDS server starts of each, REPEATS load runs per
# point on each start (fresh prompts every run). Only DIR.tgz stays (the device tool brings back at
# most 8 files a call, and none deeper than two folders).
# END_BY (epoch seconds), when set, is when the call must be done: bench.engine gets SIGINT early
# enough to stop its servers, report what it measured and leave the .tgz.
#
# Flatfare runs from its installed wheel, never from the source tree: flatfare.gateway, .workers, .billing
# and .migrations exist only through the wheel's package-dir mapping (pyproject.toml), so the checkout's
# bare flatfare/ folder must never be on the path. bench/ is not in the wheel: /tmp/ffbench holds a link
# to it, and nothing else, for `python -m bench`.
# FFSITE, FFBENCH, GPU_WHEELS, PYTHON and VLLM_ENV may be set for tests/deploy/test_gpu_recipe.py, which
# runs install-flatfare and bench's Flatfare stack on the CPU machine (no vLLM there).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FFSITE=${FFSITE:-/tmp/ffsite}
FFVISION=${FFVISION:-/tmp/ffvision}
FFBENCH=${FFBENCH:-/tmp/ffbench}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu_wheels}
VISION_WHEELS=${GPU_VISION:-$ROOT/.gpu_vision}
PYTHON=${PYTHON:-python3}
VLLM_ENV=${VLLM_ENV:-/tmp/vllm_env.sh}
say() { echo "[gpu_device] $*"; }
die() { echo "[gpu_device] $*" >&2; exit 1; }
left() { echo $(( ${END_BY:-$(( $(date +%s) + 100000 ))} - $(date +%s) )); }

free_gpu() {
  # bench.engine starts its servers in sessions of their own and stops them itself, even on SIGINT; only a
  # SIGKILL (the deadline's last resort) leaves them, and the GPU with them. End those by pid: the GPU
  # processes of this benchmark still there (vllm serve, flatfare worker, vllm_bench.py, and the engine
  # cores they spawned through multiprocessing).
  local pid
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' '); do
    if ps -o args= -p "$pid" 2>/dev/null | grep -qE 'vllm|flatfare|multiprocessing'; then
      say "pid $pid still holds the GPU ($(ps -o args= -p "$pid" | cut -c1-80)): stopping it"
      kill "$pid" 2>/dev/null || true
      sleep 5
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}

env_flatfare() {
  # vLLM 0.26's /tmp/site (device_setup.sh install) first, as before, so its fastapi and pydantic win; then
  # the installed wheels, then bench/ alone. The checkout's root is not on the path.
  # shellcheck disable=SC1090
  if [ -f "$VLLM_ENV" ]; then . "$VLLM_ENV"; fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$FFSITE:$FFBENCH
  # Nor is the working folder (Python >= 3.11): `python -m bench` runs in the checkout's root, and bench.engine
  # starts its load generator and vllm serve there, where the bare ./flatfare would come first.
  export PYTHONSAFEPATH=1
  export PATH=$FFSITE/bin:$PATH
}

install_flatfare() {
  # The wheel `python -m bench gpu prepare` built from the checkout, with the wheels named (setup: whl/*, the
  # dependencies; the rest come with the vLLM payload). One pip call for all: with --target --upgrade,
  # each call replaces the folders it installs whole, bin/ included (a second call would drop py-spy).
  local wheels=("$WHEELS"/flatfare/flatfare-*.whl) out
  [ -f "${wheels[0]}" ] || die "no wheel in $WHEELS/flatfare: run python -m bench gpu prepare (carry .gpu_wheels)"
  [ "${#wheels[@]}" -eq 1 ] || die "more than one Flatfare wheel in $WHEELS/flatfare: ${wheels[*]}"
  mkdir -p "$FFSITE"
  out=$("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FFSITE" \
    "${wheels[0]}" "$@" 2>&1) || die "pip could not install the wheels into $FFSITE: $out"
  grep -v 'WARNING: Target directory' <<< "$out" || true
  say "installed $(basename "${wheels[0]}") and $# other wheels into $FFSITE"
}

check_flatfare() {
  # In the checkout's root, where bench.engine runs and a bare flatfare/ lies, every module must still come
  # from $FFSITE, and the wheel's `flatfare migrate` must bring a new SQLite file to head. Nothing here needs
  # vLLM (the engine adapter imports it when an engine starts); setup imports vLLM on its own.
  ( env_flatfare
    cd "$ROOT"
    "$PYTHON" - "$FFSITE" <<'EOF'
import importlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

site = Path(sys.argv[1]).resolve()
for name in ("flatfare", "flatfare.migrations", "flatfare.cli.main", "flatfare.gateway.app", "flatfare.workers.main",
             "flatfare.workers.engine", "flatfare.billing.ledger"):
    origin = Path(importlib.import_module(name).__file__).resolve()
    if not origin.is_relative_to(site):
        sys.exit(f"[gpu_device] {name} comes from {origin}, not from {site}: the source tree shadows the wheel")
command = shutil.which("flatfare")
if command is None or not Path(command).resolve().is_relative_to(site):
    sys.exit(f"[gpu_device] the flatfare command is {command}, not {site}/bin/flatfare")
print(f"[gpu_device] flatfare imports from {site / 'flatfare'}")

from alembic.script import ScriptDirectory

from flatfare.storage.db import alembic_config

with tempfile.TemporaryDirectory() as scratch:
    url = f"sqlite:///{scratch}/check.db"
    done = subprocess.run([command, "migrate"], cwd=scratch, capture_output=True, text=True, check=False,
                          env={**os.environ, "FLATFARE_DATABASE_URL": url, "FLATFARE_DATA_DIR": scratch})
    if done.returncode != 0:
        sys.exit(f"[gpu_device] flatfare migrate failed (rc {done.returncode}):\n{done.stdout}{done.stderr}")
    with sqlite3.connect(f"{scratch}/check.db") as conn:
        (version,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    if version != head:
        sys.exit(f"[gpu_device] flatfare migrate stopped at {version}, not at head {head}")
print(f"[gpu_device] flatfare migrate: a new SQLite file at head {head}")
EOF
  )
}

link_bench() {
  mkdir -p "$FFBENCH"
  ln -sfn "$ROOT/bench" "$FFBENCH/bench"
}

setup() {
  [ -d "$WHEELS/whl" ] || die ".gpu_wheels not carried"
  install_flatfare "$WHEELS"/whl/*.whl
  if [ -d "$VISION_WHEELS" ]; then  # bench/gpu.py VISION_WHEELS (.gpu_vision, carried for capabilities only)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FFVISION" \
      "$VISION_WHEELS"/*.whl 2>&1 | grep -v 'WARNING: Target directory' || true
  fi
  mkdir -p "$FFSITE/bin" "$FFSITE/lib"
  link_bench
  cp "$WHEELS"/redis/lib/* "$FFSITE/lib/"
  cp "$WHEELS"/redis/redis-server "$FFSITE/lib/redis-server.bin"
  # A wrapper, so only redis-server sees the carried libraries (liblzf, libjemalloc).
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib exec %s/lib/redis-server.bin "$@"\n' "$FFSITE" "$FFSITE" > "$FFSITE/bin/redis-server"
  chmod +x "$FFSITE/bin/redis-server" "$FFSITE/lib/redis-server.bin"
  cp "$ROOT/bench/device_sitecustomize.py" "$FFSITE/sitecustomize.py"  # vLLM 0.26 shim, see the file
  env_flatfare
  redis-server --version
  if command -v py-spy > /dev/null; then py-spy --version; else say "no py-spy: PYSPY runs record nothing"; fi
  check_flatfare
  # What the device needs beyond the check: vLLM itself, bench (through /tmp/ffbench) and the dependencies.
  (cd "$ROOT" && "$PYTHON" -c 'import vllm, bench, bench.engine, sqlalchemy, redis, hiredis, async_lru, alembic
import orjson, pydantic_settings
from pathlib import Path
assert Path(bench.__file__).parent.parent == Path("'"$FFBENCH"'"), bench.__file__
print("[gpu_device] vllm", vllm.__version__, "and bench.engine import")')
}

run() {
  local shape=${1:?shape 8b|1b} rounds=${2:-1} dir=${3:?result dir}
  env_flatfare
  [ -f "/tmp/m$shape/config.json" ] || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model --shape "$shape" \
    --out "/tmp/m$shape" --no-weights > /dev/null
  mkdir -p "$dir"
  local order=(vllm flatfare) options=${ENGINE_OPTIONS:-} spy=()
  [ -n "$options" ] || options='{"load_format": "dummy"}'  # both systems get exactly these
  [ "${ORDER:-}" = "flatfare-first" ] && order=(flatfare vllm)
  [ -n "${SYSTEMS:-}" ] && read -r -a order <<< "$SYSTEMS"
  [ -n "${PYSPY:-}" ] && [ "${PYSPY}" != 0 ] && spy=(--py-spy "$PYSPY")
  [ -n "${VIA_CATALOG:-}" ] && spy+=(--via-catalog)  # Flatfare's options from a catalog entry
  # SIGINT 50 s before END_BY (bench.engine then stops its servers, up to ~20 s, and writes its tables),
  # SIGKILL 35 s later: the tar below still runs in time.
  local budget=$(( $(left) - 50 ))
  [ "$budget" -gt 60 ] || { say "only $(left) s left: not starting"; return 1; }
  free_gpu
  # shellcheck disable=SC2086
  timeout -s INT -k 35 "$budget" python3 -m bench engine --model-dir "/tmp/m$shape" --name "llama-$shape" \
    --engine-options "$options" --concurrency ${CONCURRENCY:-1 16 64 256} --requests ${REQUESTS:-10 96 500 500} \
    --input-len 512 --output-len 128 --rounds "$rounds" --repeats "${REPEATS:-3}" --systems "${order[@]}" \
    --gateway-processes "${GATEWAY_PROCESSES:-4}" --tag "gpu-$shape${TAG_SUFFIX:-}" --out "$dir" \
    --ready-timeout 400 "${spy[@]}" || say "bench.engine failed or was stopped (rc $?)"
  free_gpu
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1 || true
  tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  rm -rf "$dir"
  say "wrote $dir.tgz ($(du -k "$dir.tgz" | cut -f1) KiB), $(left) s left"
}

offline() {
  # The engine's rate with no server in front (vllm.LLM, 512 prompts of 512 random tokens, 128 out, ignore_eos):
  # the ceiling the served 1B rate is compared with. ~90 s for the 1B shape (start ~60 s, 2 timed runs).
  local shape=${1:?shape 8b|1b} out=${2:?result path, no suffix} need=${OFFLINE_NEEDS_S:-120}
  env_flatfare
  if [ "$(left)" -lt "$need" ]; then
    say "offline skipped: $(left) s left, it needs ~$need s (run it in the next call)"
    return 0
  fi
  [ -f "/tmp/m$shape/config.json" ] || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model --shape "$shape" \
    --out "/tmp/m$shape" --no-weights > /dev/null
  free_gpu
  timeout -s INT -k 15 $(( $(left) - 20 )) python3 "$ROOT/.gpu_tools/vllm_bench.py" offline --model "/tmp/m$shape" \
    --load-format dummy --json "$out.json" > "$out.log" 2>&1 || say "offline failed or was stopped (rc $?)"
  grep '^\[offline\] run' "$out.log" || tail -20 "$out.log"
}

capabilities() {
  # bench.capabilities on real shapes with random weights (load_format dummy), each catalog entry on a stack of
  # its own: qwen3-thinking and qwen3-tools on the Qwen3-8B shape, llava on the LLaVA-1.5-7B shape. One JSON
  # per entry and its logs in DIR.tgz. ENTRIES narrows the list; CAPS_OPTIONS (JSON) is merged over each entry
  # (enforce_eager by default: these checks are about formats, and it saves ~30 s a start).
  local dir=${1:?result dir} entry arch size
  env_flatfare
  mkdir -p "$dir"
  free_gpu
  for entry in ${ENTRIES:-qwen3-thinking qwen3-tools llava}; do
    arch=${entry%%-*}; size=8b; [ "$arch" = llava ] && size=7b
    [ -f "/tmp/c$arch/config.json" ] || (cd "$ROOT" && python3 -m bench capabilities make-model --arch "$arch" \
      --size "$size" --tokenizer "$VLLM_TOK_DIR" --out "/tmp/c$arch") > "$dir/make-$arch.log" 2>&1 \
      || { tail -5 "$dir/make-$arch.log"; continue; }
    [ "$(left)" -gt 150 ] || { say "$entry skipped: $(left) s left"; continue; }
    # vLLM 0.26's LLaVA imports mistral_common with its dependencies (bench/gpu.py VISION_WHEELS, in
    # $FFVISION), and Pixtral names the device's newer transformers renamed (bench/device_sitecustomize.py).
    compat=""; [ "$arch" = llava ] && compat="$FFVISION"
    (cd "$ROOT" && PYTHONPATH=${compat:+$compat:}$PYTHONPATH timeout -s INT -k 20 $(( $(left) - 40 )) \
      python3 -m bench capabilities run --entry "$entry" \
      --model-dir "/tmp/c$arch" --workdir "/tmp/ffcaps-$entry" --json "$dir/$entry.json" --ready-timeout 400 \
      --engine-options "${CAPS_OPTIONS:-{\"enforce_eager\": true\}}") \
      > "$dir/$entry.log" 2>&1 || say "$entry: some checks failed or it stopped (rc $?)"
    grep '^\[capabilities\]' "$dir/$entry.log" | cut -c1-200 || tail -5 "$dir/$entry.log"
    cp /tmp/ffcaps-$entry/worker.log "$dir/$entry-worker.log" 2>/dev/null || true
    free_gpu
  done
  tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  rm -rf "$dir"
}

fleet() {
  # bench.fleet gpu: Flatfare's whole path with one `flatfare fleet --max-awake 1` (its workers start with vLLM's
  # sleep mode). `levels`: two entries on one folder with real weights (level 2 reloads them from disk; SHAPE,
  # default 1b, made once in /tmp/w$SHAPE), full starts vs level-1 and level-2 wakes. `many`: MODELS (default 6)
  # entries on one 8B folder (load_format dummy, level 1), started one by one, then each woken (ROUNDS, default
  # 2). FLEET_OPTIONS (JSON) replaces the entries' options. DIR.tgz holds the JSON, the table and the logs.
  local part=${1:?part levels|many} dir=${2:?result dir} shape model options
  env_flatfare
  mkdir -p "$dir"
  if [ "$part" = levels ]; then
    shape=${SHAPE:-1b}; model=/tmp/w$shape; options=${FLEET_OPTIONS:-'{"gpu_memory_utilization": 0.85}'}
    ls "$model"/*.safetensors > /dev/null 2>&1 || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model \
      --shape "$shape" --out "$model" > "$dir/make-model.log" 2>&1 || { tail -5 "$dir/make-model.log"; return 1; }
  else
    shape=${SHAPE:-8b}; model=/tmp/m$shape
    options=${FLEET_OPTIONS:-'{"load_format": "dummy", "enforce_eager": true, "gpu_memory_utilization": 0.8}'}
    [ -f "$model/config.json" ] || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model --shape "$shape" \
      --out "$model" --no-weights > /dev/null
  fi
  [ "$(left)" -gt 150 ] || { say "fleet $part: only $(left) s left: not starting"; return 1; }
  free_gpu
  # The bench stops sending 60 s before END_BY (what it measured stays in its JSON, written after every
  # request), SIGINT 40 s before it, SIGKILL 25 s later: the tar below still runs in time.
  (cd "$ROOT" && timeout -s INT -k 25 $(( $(left) - 40 )) python3 -m bench fleet gpu --part "$part" \
    --model-dir "$model" --models "${MODELS:-6}" --rounds "${ROUNDS:-2}" --engine-options "$options" \
    --end-by $(( $(date +%s) + $(left) - 60 )) --workdir "/tmp/fffleet-$part" --out "$dir/fleet_gpu_$part") \
    > "$dir/$part.log" 2>&1 || say "bench.fleet $part failed or was stopped (rc $?)"
  grep '^\[fleet\]' "$dir/$part.log" | cut -c1-200 || tail -20 "$dir/$part.log"
  cp -r "/tmp/fffleet-$part/logs" "$dir/logs" 2>/dev/null || true
  cp "/tmp/fffleet-$part/fleet.log" "/tmp/fffleet-$part/gateway.log" "$dir/" 2>/dev/null || true
  free_gpu
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1 || true
  tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  rm -rf "$dir"
  say "wrote $dir.tgz ($(du -k "$dir.tgz" | cut -f1) KiB), $(left) s left"
}

rehearsal() {
  # bench.rehearsal (issue 32): the Azure trace through Flatfare's whole path, then through vllm serve, on the same
  # 8B-shape model (random weights), with a 1B-shape second model beside it on the same GPU for Flatfare.
  #   rehearsal start DIR        make the models, then run everything in the background (setsid: it outlives this
  #                              call, for as long as the machine stays warm), logging to DIR/driver.log
  #   rehearsal wait DIR SECS    follow it until DIR/DONE or SECS pass; pack DIR (JSON, logs) into $OUT/rehearsal.tgz
  # MAIN_OPTIONS / SECOND_OPTIONS (JSON: catalog entries, and vllm serve's, for the main model), COMPRESSION,
  # PEAK_LOAD, REHEARSAL_ARGS (more `bench rehearsal run` flags), SYSTEMS ("flatfare vllm").
  local verb=${1:?start|wait} dir=${2:?result dir}
  case "$verb" in
    start)
      mkdir -p "$dir"
      setsid nohup bash "$ROOT/bench/gpu_device.sh" rehearsal run "$dir" > "$dir/driver.log" 2>&1 < /dev/null &
      say "rehearsal running in the background (pid $!), log $dir/driver.log" ;;
    run) rehearsal_run "$dir" ;;
    wait)
      local until=$(( $(date +%s) + ${3:-500} )) seen=0
      while [ ! -f "$dir/DONE" ] && [ "$(date +%s)" -lt "$until" ]; do
        sleep 5
        # Either log may not exist yet (vllm.log appears only once the vllm serve phase starts): under
        # pipefail a missing file must not end the wait.
        local progress lines
        progress=$( { cat "$dir"/flatfare.log "$dir"/vllm.log 2>/dev/null || true; } | grep '^\[rehearsal' || true)
        lines=$(printf '%s' "$progress" | grep -c '' || true)
        if [ "$lines" -gt "$seen" ]; then
          printf '%s\n' "$progress" | tail -n +$((seen + 1)) | cut -c1-240
          seen=$lines
        fi
      done
      [ -f "$dir/DONE" ] && say "rehearsal done" || say "rehearsal still running"
      tail -5 "$dir/driver.log" 2>/dev/null || true
      if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/rehearsal.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
        say "packed $(du -k "$OUT/rehearsal.tgz" | cut -f1) KiB"
      fi ;;
    *) die "rehearsal start|wait DIR" ;;
  esac
}

rehearsal_run() {
  local dir=$1 shape main second
  env_flatfare
  main=${MAIN_OPTIONS:-'{"load_format": "dummy", "gpu_memory_utilization": 0.62, "max_num_batched_tokens": 2048}'}
  second=${SECOND_OPTIONS:-'{"load_format": "dummy", "gpu_memory_utilization": 0.22, "enforce_eager": true}'}
  for shape in 8b 1b; do
    [ -f "/tmp/m$shape/config.json" ] || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model --shape "$shape" \
      --out "/tmp/m$shape" --no-weights --max-len 16384 > /dev/null
  done
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1 || true
  free_gpu
  if [[ " ${SYSTEMS:-flatfare vllm} " == *" flatfare "* ]]; then
    # shellcheck disable=SC2086
    (cd "$ROOT" && python3 -m bench rehearsal run --system flatfare --out "$dir/flatfare.json" --workdir /tmp/rh-ff \
      --main-name llama-8b --main-source /tmp/m8b --main-options "$main" --second-name llama-1b \
      --second-source /tmp/m1b --second-options "$second" --tokenizer "$VLLM_TOK_DIR" --gpus 0 --max-awake 2 \
      --gateway-processes 4 --compression "${COMPRESSION:-17}" --peak-load "${PEAK_LOAD:-1.4}" ${REHEARSAL_ARGS:-}) \
      > "$dir/flatfare.log" 2>&1 || say "the Flatfare run failed or was stopped (rc $?)"
    mkdir -p "$dir/logs"
    cp /tmp/rh-ff/*.log "$dir/logs/" 2>/dev/null || true
    for log in /tmp/rh-ff/logs/*; do [ -f "$log" ] && tail -c 2000000 "$log" > "$dir/logs/$(basename "$log")"; done
    free_gpu
  fi
  if [[ " ${SYSTEMS:-flatfare vllm} " == *" vllm "* ]] && [ -f "$dir/flatfare.json" ]; then
    (cd "$ROOT" && python3 -m bench rehearsal run --system vllm --plan-from "$dir/flatfare.json" \
      --main-source /tmp/m8b --tokenizer "$VLLM_TOK_DIR" --out "$dir/vllm.json" --workdir /tmp/rh-vs) \
      > "$dir/vllm.log" 2>&1 || say "the vllm serve run failed or was stopped (rc $?)"
    mkdir -p "$dir/logs"
    tail -c 2000000 /tmp/rh-vs/vllm_serve.log > "$dir/logs/vllm_serve.log" 2>/dev/null || true
    free_gpu
  fi
  touch "$dir/DONE"
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  install-flatfare) install_flatfare; link_bench; check_flatfare ;;
  check-flatfare) check_flatfare ;;
  python) env_flatfare; cd "$ROOT"; exec "$PYTHON" "$@" ;;
  run) run "$@" ;;
  offline) offline "$@" ;;
  capabilities) capabilities "$@" ;;
  fleet) fleet "$@" ;;
  rehearsal) rehearsal "$@" ;;
  *) echo "usage: $0 setup | install-flatfare | check-flatfare | python ARGS | run SHAPE ROUNDS DIR |" \
          "offline SHAPE DIR | capabilities DIR | fleet levels|many DIR | rehearsal start|wait DIR [SECS]" >&2
     exit 2 ;;
esac
