#!/usr/bin/env bash
# Sets up everything horovod_zero needs on a fresh machine and builds it in place:
# a virtual environment (kept across runs in $HOROVOD_ZERO_VENV) with torch, the
# build and test tools and Horovod's launcher, then the C++ core and extension.
# Prints the environment's python on its last line.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HOROVOD_ZERO_VENV:-$HOME/.cache/horovod_zero/venv-torch2.11}
PY=${PYTHON:-python3}

if ! "$VENV/bin/python" -c "import torch, pytest, ninja, cmake, horovod.runner" >/dev/null 2>&1; then
  echo "[setup] creating $VENV (torch 2.11, pytest, cmake, ninja, Horovod's launcher)" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.11.0 numpy pytest pytest-timeout cmake ninja \
      cloudpickle psutil pyyaml packaging >&2
  # Horovod's launcher only: its C++ extensions do not build against current torch,
  # and horovod_zero does not need them.
  HOROVOD_SKIP_COMPILE=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      "$VENV/bin/pip" install -q --disable-pip-version-check horovod==0.28.1 >&2
fi

cd "$ROOT"
echo "[setup] building horovod_zero (CMake, build dir $ROOT/build/cmake)" >&2
export PATH="$VENV/bin:$PATH"
HVDZ_BUILD_JOBS=${HVDZ_BUILD_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace >&2 \
  || { echo "[setup] build failed" >&2; exit 1; }
echo "$VENV/bin/python"
