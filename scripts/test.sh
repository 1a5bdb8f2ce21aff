#!/usr/bin/env bash
# Install Flatfare with its test extra (first run only) and run the whole test suite.
# Needs a PostgreSQL for the storage tests (FLATFARE_TEST_POSTGRES_URL, default 127.0.0.1:5432/test).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
exec .venv/bin/python -m pytest "$@"
