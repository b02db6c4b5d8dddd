#!/usr/bin/env bash
# Sets up everything horovod_zero needs on a fresh machine and builds it in place:
# a virtual environment (kept across runs in $HOROVOD_ZERO_VENV) with torch, the
# build and test tools and Horovod's launcher, then the C++ core and extension.
# It also installs the Debian packages the build and tests use (liburing for NVMe
# offload, GoogleTest, Open MPI's mpirun) when they are missing and apt-get can be
# run, and makes `horovodrun` and `import horovod_zero` work in the environment.
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

# Debian packages: liburing-dev for NVMe offload (HVDZ_LIBURING_ROOT may name a copy
# instead), libgtest-dev for the C++ tests, openmpi-bin for the mpirun launch test.
missing=()
[ -f /usr/include/liburing.h ] || [ -n "${HVDZ_LIBURING_ROOT:-}" ] || missing+=(liburing-dev)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${missing[*]} (apt-get)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >&2 \
      || echo "[setup] could not install ${missing[*]}; the tests that need them will fail" >&2
  else
    echo "[setup] missing Debian packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})" >&2
  fi
fi

# This checkout is importable from the environment (as an editable install would
# make it), and the environment's horovodrun is ours: Horovod's own refuses to
# start without its C++ extensions, which horovod_zero replaces
# (horovod_zero/runner/launch.py runs Horovod's launcher code in Gloo mode).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$SITE/horovod_zero_checkout.pth"
cat > "$VENV/bin/horovodrun" <<EOF
#!$VENV/bin/python
# horovod_zero's horovodrun (written by examples/setup.sh); the guard lets
# Horovod's launcher start its helper processes with multiprocessing's spawn.
import sys
from horovod_zero.runner.launch import main
if __name__ == "__main__":
    sys.exit(main())
EOF
chmod +x "$VENV/bin/horovodrun"

cd "$ROOT"
echo "[setup] building horovod_zero (CMake, build dir $ROOT/build/cmake)" >&2
export PATH="$VENV/bin:$PATH"
HVDZ_BUILD_JOBS=${HVDZ_BUILD_JOBS:-$(nproc)} "$VENV/bin/python" setup.py -q build_ext --inplace >&2 \
  || { echo "[setup] build failed" >&2; exit 1; }
echo "$VENV/bin/python"
