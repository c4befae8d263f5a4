#!/usr/bin/env bash
# Sets up and runs every test: the Catch2 suite (ctest) and the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

bash scripts/setup.sh

echo "== C++ tests (Catch2 through ctest)"
ctest --test-dir build --output-on-failure --timeout 900

echo "== Python tests (pytest)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m pytest tests/python -q -p no:cacheprovider "$@"
