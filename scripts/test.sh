#!/usr/bin/env bash
# Sets up and runs every test: the Catch2 suite (ctest), then the pytest suite even when the
# first failed. Prints both suites' summaries at the end and exits non-zero if either failed
# (pytest's "no tests collected", exit 5, counts as a failure). Arguments go to pytest:
#   bash scripts/test.sh -k stage3 -x
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The full build: the Catch2 tests and the C++ examples too (ctest runs the example).
bash scripts/setup.sh --all

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

echo "== C++ tests (Catch2 through ctest)"
ctest_rc=0
# --no-tests=error: a build configured without the tests must not pass as "nothing failed".
ctest --test-dir build --output-on-failure --timeout 900 --no-tests=error 2>&1 | tee "$logs/ctest" \
  || ctest_rc=${PIPESTATUS[0]}

echo "== Python tests (pytest)"
pytest_rc=0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m pytest tests/python -q -p no:cacheprovider "$@" 2>&1 \
  | tee "$logs/pytest" || pytest_rc=${PIPESTATUS[0]}

# The closing lines of each: ctest's from its "% tests passed" line on (with the list of the
# failed tests), pytest's short summary (failures and errors) or, without one, its last line.
echo
echo "== Summary"
echo "ctest (exit $ctest_rc):"
if grep -q "% tests passed" "$logs/ctest"; then
  sed -n '/% tests passed/,$p' "$logs/ctest" | grep -v '^$' | sed 's/^/  /'
else
  tail -n 3 "$logs/ctest" | sed 's/^/  /'
fi
echo "pytest (exit $pytest_rc):"
if grep -q "short test summary info" "$logs/pytest"; then
  sed -n '/short test summary info/,$p' "$logs/pytest" | sed 's/^/  /'
else
  tail -n 1 "$logs/pytest" | sed 's/^/  /'
fi

if [ "$ctest_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ]; then
  echo "test: FAILED (ctest exit $ctest_rc, pytest exit $pytest_rc)"
  # ctest's status if it failed, else pytest's (5: no tests collected).
  exit $((ctest_rc != 0 ? ctest_rc : pytest_rc))
fi
echo "test: all passed"
