#!/usr/bin/env bash
# On a developer machine (PyPI and Debian's archive reachable): gathers what DeepSpeed needs on
# the GPU machine, which has torch but no package registry, into build/deps/deepspeed/, for the
# device tool to carry there (then `source test/gpu/deepspeed_env.sh` on that machine):
#   wheels/  DeepSpeed built as a pure-Python wheel (DS_BUILD_OPS=0: its ops compile just in time
#            there) and its dependencies' wheels for the GPU machine's Python (3.12, manylinux x86_64);
#   libaio/  libaio's header and library (Debian's libaio1, libaio-dev) for DeepSpeed's NVMe swapper.
# DS_VERSION, PYVER (the GPU machine's Python), DEST, TORCH_PYTHON (a Python with torch 2.11, by
# default the venv that examples/setup.sh makes) and WITH_NUMPY=1 (numpy too: +16 MiB) override.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DS_VERSION=${DS_VERSION:-0.19.8}
PYVER=${PYVER:-3.12}
DEST=${DEST:-$ROOT/build/deps/deepspeed}
TORCH_PYTHON=${TORCH_PYTHON:-$HOME/.cache/horovod_zero/venv-torch2.11/bin/python}

if ! "$TORCH_PYTHON" -c 'import torch' 2>/dev/null; then
  echo "deepspeed_deps: $TORCH_PYTHON cannot import torch; run 'bash examples/setup.sh' first," \
       "or set TORCH_PYTHON to a Python that has torch 2.11" >&2
  exit 1
fi
WORK=$(mktemp -d /tmp/hvdz-ds-deps.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/libaio/include" "$DEST/libaio/lib"

# DeepSpeed's setup.py imports torch. A throw-away venv with wheel and setuptools sees torch
# through a .pth file, so the shared venv is only read, and no second torch is downloaded.
"$TORCH_PYTHON" -m venv "$WORK/venv"
site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$TORCH_PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/hvdz_torch.pth"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check wheel setuptools
echo "deepspeed_deps: building deepspeed $DS_VERSION (pure Python, ops just in time)"
(cd "$WORK" && DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$WORK/venv/bin/python" -m pip wheel -q --disable-pip-version-check \
  --no-deps --no-build-isolation "deepspeed==$DS_VERSION" -w "$DEST/wheels" > "$WORK/wheel.log" 2>&1) \
  || { tail -30 "$WORK/wheel.log"; exit 1; }

# Its requirements (requirements/requirements.txt) but torch, resolved together so that
# pydantic and pydantic_core agree, as binaries for the GPU machine's Python.
extra=(); [ "${WITH_NUMPY:-0}" = 1 ] && extra=(numpy)
"$WORK/venv/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --implementation cp --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEST/wheels" \
  hjson "pydantic>=2" py-cpuinfo msgpack ninja einops tqdm psutil "packaging>=20" "${extra[@]}"

# libaio: the real shared object (a link may not survive the carry), under both names the
# linker (-laio) and the loader (libaio.so.1) look for.
(cd "$WORK" && apt-get download -q libaio1 libaio-dev > "$WORK/apt.log" 2>&1) \
  || { cat "$WORK/apt.log"; echo "deepspeed_deps: apt-get download failed; run 'apt-get update' first" >&2; exit 1; }
for deb in "$WORK"/libaio*.deb; do dpkg-deb -x "$deb" "$WORK/aio"; done
so=$(find "$WORK/aio" -name 'libaio.so.1*' -type f | head -n 1)
[ -n "$so" ] || { echo "deepspeed_deps: no libaio.so.1 in the Debian packages" >&2; exit 1; }
cp "$so" "$DEST/libaio/lib/libaio.so.1"
cp "$so" "$DEST/libaio/lib/libaio.so"
cp "$(find "$WORK/aio" -name libaio.h | head -n 1)" "$DEST/libaio/include/"

echo "deepspeed $DS_VERSION" > "$DEST/VERSION"
ls "$DEST/wheels"
echo "deepspeed_deps: $DEST holds $(du -sh "$DEST" | cut -f1)"
