#!/usr/bin/env bash
# Sets up everything horovod_zero needs on a fresh machine and builds it in place:
# a virtual environment (kept across runs in $HOROVOD_ZERO_VENV) with torch, the
# build and test tools and Horovod's launcher, then the C++ core and extension.
# It also installs the Debian packages the build and tests use (liburing for NVMe
# offload, GoogleTest, Open MPI's mpirun) when they are missing and apt-get can be
# run, and makes `horovodrun`, `import horovod_zero` and `import horovod.torch` (as
# horovod_zero's API) work in the environment.
# Prints one `[setup]` line per stage on stderr, and the environment's python as the
# last line of stdout (test/run.sh and examples/run.sh read it). Each stage's full
# output goes to build/setup.log.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HOROVOD_ZERO_VENV:-$HOME/.cache/horovod_zero/venv-torch2.11}
PY=${PYTHON:-python3}
LOG=$ROOT/build/setup.log
mkdir -p "$ROOT/build"
: > "$LOG"

say() { echo "[setup] $*" >&2; }

# logged WHAT CMD...: runs CMD with its output in $LOG only. While it runs, a line every
# 20 s shows it is alive (with the log's last line: the package pip is on, ninja's step);
# if it fails, the end of the log is shown. Returns CMD's status.
logged() {
  local what=$1 start rc=0 ticker
  shift
  start=$(date +%s)
  printf '\n== %s: %s\n' "$what" "$*" >> "$LOG"
  # The ticker's sleep keeps no pipe open, so a reader of this script's output never waits on it.
  ( while sleep 20 </dev/null >/dev/null 2>&1 && kill -0 $$ 2>/dev/null; do
      say "  $what: $(( $(date +%s) - start )) s; $(tail -n 1 "$LOG" | cut -c 1-100)"
    done ) >/dev/null &
  ticker=$!
  "$@" >> "$LOG" 2>&1 || rc=$?
  kill "$ticker" 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    say "$what failed (exit $rc); the end of $LOG:"
    tail -n 30 "$LOG" | sed 's/^/    /' >&2
  fi
  return "$rc"
}

if "$VENV/bin/python" -c "import torch, pytest, ninja, cmake, scikit_build_core, safetensors, horovod.runner" \
    >/dev/null 2>&1; then
  say "environment $VENV"
else
  say "setting up $VENV: torch 2.11, pytest, cmake, ninja, scikit-build-core, Horovod's launcher (a few minutes the first time)"
  pip=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar off)
  logged "creating the environment" "$PY" -m venv "$VENV" || exit 1
  logged "installing torch and the tools" "${pip[@]}" torch==2.11.0 numpy pytest pytest-timeout cmake ninja \
      scikit-build-core cloudpickle psutil pyyaml packaging safetensors || exit 1
  # Horovod's launcher only: its C++ extensions do not build against current torch,
  # and horovod_zero does not need them.
  HOROVOD_SKIP_COMPILE=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      logged "installing Horovod's launcher" "${pip[@]}" horovod==0.28.1 || exit 1
fi

# Debian packages: liburing-dev for NVMe offload (HVDZ_LIBURING_ROOT may name a copy
# instead), libgtest-dev for the C++ tests, openmpi-bin for the mpirun launch test.
missing=()
[ -f /usr/include/liburing.h ] || [ -n "${HVDZ_LIBURING_ROOT:-}" ] || missing+=(liburing-dev)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${missing[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive logged "apt-get" sh -c 'apt-get update -qq && apt-get install -y -qq "$@"' sh "${missing[@]}" \
      || say "could not install ${missing[*]}; the tests that need them will fail"
  else
    say "missing Debian packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})"
  fi
fi

# This checkout is importable from the environment (as an editable install would
# make it), and the environment's horovodrun and horovod.torch are ours: Horovod's
# own refuse to run without its C++ extensions, which horovod_zero replaces
# (horovod_zero/runner/launch.py runs Horovod's launcher code in Gloo mode;
# horovod_zero/horovod_compat.py answers `import horovod.torch` with horovod_zero.torch).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$SITE/horovod_zero_checkout.pth"
logged "making horovod.torch horovod_zero's" "$VENV/bin/python" -m horovod_zero.horovod_compat install || exit 1
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

say "building horovod_zero in ${HVDZ_BUILD_DIR:-$ROOT/build/cmake} (log: $LOG)"
start=$(date +%s)
PATH="$VENV/bin:$PATH" logged "building" bash "$ROOT/examples/build.sh" "$VENV/bin/python" || exit 1
say "built in $(( $(date +%s) - start )) s"
echo "$VENV/bin/python"
