#!/usr/bin/env bash
# Run the tests on a machine made busy: one busy loop (`yes > /dev/null`) per core for the whole run,
# so every timing bound and wait in the suite is tried where the gateway, workers, Redis, PostgreSQL
# and pytest get only part of a CPU. Arguments go to pytest through scripts/test.sh, e.g.
#   scripts/stress-test.sh -q tests/security tests/gateway
# STRESS_LOOPS overrides the number of loops (default: nproc). Installs nothing beyond scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

loops=${STRESS_LOOPS:-$(nproc)}
pids=()
stop_loops() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_loops EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq "$loops"); do
    yes >/dev/null &
    pids+=("$!")
done

echo "stress-test: $loops busy loop(s) on $(nproc) core(s); pytest $*" >&2
started=$(date +%s)
status=0
scripts/test.sh "$@" || status=$?
took=$(($(date +%s) - started))
echo "stress-test: pytest exited $status after ${took} s ($((took / 60)) min $((took % 60)) s) under $loops busy loop(s)" >&2
exit "$status"
