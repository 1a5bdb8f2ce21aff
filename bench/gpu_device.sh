#!/usr/bin/env bash
# Runs ON THE DEVICE MACHINE (the device tool's `run`), from the checkout's root, after
# `.gpu_tools/device_setup.sh install` (vLLM 0.26 in /tmp/site, /tmp/vllm_env.sh written).
#
#   bash bench/gpu_device.sh setup                 # Flatfare's own deps (.gpu_wheels) into /tmp/ffsite
#   bash bench/gpu_device.sh run SHAPE ROUNDS DIR  # SHAPE 8b|1b: make the model, run bench.engine, tar DIR
#
# `run` compares Flatfare (private Redis, SQLite, flatfare worker + gateway) with `vllm serve` on a
# random-weight Llama of that shape (--load-format dummy), input 512 / output 128, ignore_eos,
# concurrency 1 16 64 256, one system at a time, and leaves DIR.tgz (the device tool brings back at
# most 8 files a call).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FFSITE=/tmp/ffsite
say() { echo "[gpu_device] $*"; }

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
  python3 -c 'import flatfare.cli, gateway.app, workers.main, workers.engine, bench.engine, sqlalchemy, redis, alembic, orjson, pydantic_settings; print("[gpu_device] flatfare imports ok")'
}

run() {
  local shape=${1:?shape 8b|1b} rounds=${2:-1} dir=${3:?result dir}
  env_flatfare
  [ -f "/tmp/m$shape/config.json" ] || python3 "$ROOT/.gpu_tools/vllm_bench.py" make-model --shape "$shape" \
    --out "/tmp/m$shape" --no-weights > /dev/null
  mkdir -p "$dir"
  local order=(vllm flatfare) options=${ENGINE_OPTIONS:-}
  [ -n "$options" ] || options='{"load_format": "dummy"}'  # both systems get exactly these
  [ "${ORDER:-}" = "flatfare-first" ] && order=(flatfare vllm)
  [ -n "${SYSTEMS:-}" ] && read -r -a order <<< "$SYSTEMS"
  python3 -m bench engine --model-dir "/tmp/m$shape" --name "llama-$shape" \
    --engine-options "$options" --concurrency 1 16 64 256 --requests ${REQUESTS:-10 96 500 500} \
    --input-len 512 --output-len 128 --rounds "$rounds" --systems "${order[@]}" \
    --gateway-processes "${GATEWAY_PROCESSES:-1}" --tag "gpu-$shape${TAG_SUFFIX:-}" --out "$dir" \
    --ready-timeout 400 || say "bench.engine failed (rc $?)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$dir/nvidia-smi.csv" 2>&1 || true
  tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  say "wrote $dir.tgz ($(du -k "$dir.tgz" | cut -f1) KiB)"
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  run) run "$@" ;;
  *) echo "usage: $0 setup | run SHAPE ROUNDS DIR" >&2; exit 2 ;;
esac
