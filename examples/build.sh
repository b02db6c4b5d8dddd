#!/usr/bin/env bash
# Builds horovod_zero in place: CMake in $HVDZ_BUILD_DIR (default build/cmake), the
# extension written into this checkout's horovod_zero/, where tests and examples import
# it. examples/setup.sh runs it with its environment's python; the GPU scripts with the
# machine's. The extension builds against the torch that python imports
# (cmake/HvdzTorch.cmake). HVDZ_CMAKE_ARGS adds CMake options, HVDZ_BUILD_JOBS sets the
# parallel jobs. The wheel is built by pip instead (pyproject.toml).
#   bash examples/build.sh [PYTHON]        PYTHON defaults to python3
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(command -v "${1:-python3}")
BUILD=${HVDZ_BUILD_DIR:-$ROOT/build/cmake}
# Split HVDZ_CMAKE_ARGS as pip builds do (shlex), so quoting means the same in both.
mapfile -t extra < <(HVDZ_CMAKE_ARGS=${HVDZ_CMAKE_ARGS:-} "$PY" -c \
  'import os, shlex; print(*shlex.split(os.environ["HVDZ_CMAKE_ARGS"]), sep="\n", end="")')
# The package directory is passed every time, as a build dir configured otherwise keeps its own.
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$PY" -DHVDZ_PACKAGE_DIR="$ROOT/horovod_zero" "${extra[@]}"
cmake --build "$BUILD" -j "${HVDZ_BUILD_JOBS:-$(nproc)}"
