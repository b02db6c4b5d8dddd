#!/usr/bin/env bash
# Sets up (examples/setup.sh), then runs the C++ tests (CTest) and the Python tests
# (pytest; GPU tests are deselected where the GPUs they need are missing: test/gpu/conftest.py).
# Fails if any test fails.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=$(bash "$ROOT/examples/setup.sh" | tail -n 1)
VENV_BIN=$(dirname "$PYTHON")
export PATH="$VENV_BIN:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "== C++ tests (ctest)"
if [ ! -x "$ROOT/build/cmake/test/cpp/hvdz_tests" ]; then
  echo "The C++ tests were not built: GoogleTest is missing (Debian: apt-get install libgtest-dev)." >&2
  exit 1
fi
(cd "$ROOT/build/cmake" && ctest --output-on-failure -j "$(nproc)")

echo "== Python tests (pytest)"
cd "$ROOT/test"
"$PYTHON" -m pytest -q -ra --durations=15 python gpu "$@"
