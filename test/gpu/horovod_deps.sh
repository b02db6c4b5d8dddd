#!/usr/bin/env bash
# Here (with network): build/deps/horovod_site, Horovod's launcher and the packages it imports,
# for the GPU machine's python 3.12 (which has no network). Carry it there (the device tool's
# carry=["build/deps/horovod_site"]); run_elastic_bench.sh puts it on PYTHONPATH.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${HOROVOD_ZERO_VENV:-$HOME/.cache/horovod_zero/venv-torch2.11}
SITE="$ROOT/build/deps/horovod_site"
WHEELS=$(mktemp -d)
rm -rf "$SITE" && mkdir -p "$SITE"
"$VENV/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$WHEELS" horovod==0.28.1 psutil cloudpickle pyyaml packaging 2>/dev/null \
  || "$VENV/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
       --platform manylinux2014_x86_64 -d "$WHEELS" psutil cloudpickle pyyaml packaging
for w in "$WHEELS"/*.whl; do "$VENV/bin/python" -m zipfile -e "$w" "$SITE"; done
# Horovod ships no wheel: its pure-Python launcher, as setup.sh installed it.
[ -d "$SITE/horovod" ] || cp -r "$("$VENV/bin/python" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')" "$SITE/"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$WHEELS"
echo "$SITE: $(du -sh "$SITE" | cut -f1)"
