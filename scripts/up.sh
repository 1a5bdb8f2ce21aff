#!/usr/bin/env bash
# Install Flatfare (first run only) and start the whole platform locally: `flatfare up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/flatfare up "$@"
