#!/usr/bin/env bash
# Runs ON THE DEVICE MACHINE (the device tool's `run`), from the checkout's root, after
# `.gpu_tools/device_setup.sh install` (vLLM 0.26 in /tmp/site, /tmp/vllm_env.sh written).
#
#   bash bench/gpu_device.sh setup                 # Flatfare's own deps and py-spy (.gpu_wheels) into /tmp/ffsite
#   bash bench/gpu_device.sh run SHAPE ROUNDS DIR  # SHAPE 8b|1b: make the model, run bench.engine, leave DIR.tgz
#   bash bench/gpu_device.sh offline SHAPE DIR     # vllm_bench.py offline on that model: DIR.json, DIR.log
#
# `run` compares Flatfare (private Redis, SQLite, flatfare worker + gateway) with `vllm serve` on a
# random-weight Llama of that shape (--load-format dummy), input 512 / output 128, ignore_eos,
# concurrency 1 16 64 256, one system at a time: ROUNDS server starts of each, REPEATS load runs per
# point on each start (fresh prompts every run). Only DIR.tgz stays (the device tool brings back at
# most 8 files a call, and none deeper than two folders).
# END_BY (epoch seconds), when set, is when the call must be done: bench.engine gets SIGINT early
# enough to stop its servers, report what it measured and leave the .tgz.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FFSITE=/tmp/ffsite
say() { echo "[gpu_device] $*"; }
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
  # shellcheck disable=SC1091
  . /tmp/vllm_env.sh
  export PYTHONPATH=$ROOT:$PYTHONPATH:$FFSITE
  export PATH=$FFSITE/bin:$PATH
}

setup() {
  [ -d "$ROOT/.gpu_wheels/whl" ] || { echo "[gpu_device] .gpu_wheels not carried" >&2; exit 1; }
  mkdir -p "$FFSITE/bin" "$FFSITE/lib"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FFSITE" \
    "$ROOT"/.gpu_wheels/whl/*.whl 2>&1 | grep -v 'WARNING: Target directory' || true
  cp "$ROOT"/.gpu_wheels/redis/lib/* "$FFSITE/lib/"
  cp "$ROOT"/.gpu_wheels/redis/redis-server "$FFSITE/lib/redis-server.bin"
  # A wrapper, so only redis-server sees the carried libraries (liblzf, libjemalloc).
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib exec %s/lib/redis-server.bin "$@"\n' "$FFSITE" "$FFSITE" > "$FFSITE/bin/redis-server"
  chmod +x "$FFSITE/bin/redis-server" "$FFSITE/lib/redis-server.bin"
  cp "$ROOT/bench/device_sitecustomize.py" "$FFSITE/sitecustomize.py"  # vLLM 0.26 shim, see the file
  env_flatfare
  redis-server --version
  if command -v py-spy > /dev/null; then py-spy --version; else say "no py-spy: PYSPY runs record nothing"; fi
  python3 -c 'import flatfare.cli.main, flatfare.gateway.app, flatfare.workers.main, flatfare.workers.engine, bench.engine, sqlalchemy, redis, hiredis, async_lru, alembic, orjson, pydantic_settings; print("[gpu_device] flatfare imports ok")'
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
  # SIGINT 50 s before END_BY (bench.engine then stops its servers, up to ~20 s, and writes its tables),
  # SIGKILL 35 s later: the tar below still runs in time.
  local budget=$(( $(left) - 50 ))
  [ "$budget" -gt 60 ] || { say "only $(left) s left: not starting"; return 1; }
  free_gpu
  # shellcheck disable=SC2086
  timeout -s INT -k 35 "$budget" python3 -m bench engine --model-dir "/tmp/m$shape" --name "llama-$shape" \
    --engine-options "$options" --concurrency 1 16 64 256 --requests ${REQUESTS:-10 96 500 500} \
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

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  run) run "$@" ;;
  offline) offline "$@" ;;
  *) echo "usage: $0 setup | run SHAPE ROUNDS DIR | offline SHAPE DIR" >&2; exit 2 ;;
esac
