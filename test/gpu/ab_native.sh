#!/usr/bin/env bash
# A/B benchmark of the C++ extension: the checkout's build against the same tree with the
# files under BEFORE_SRC in place of their namesakes (e.g. `git archive <commit>
# csrc/runtime/handle_table.cc csrc/runtime/handle_table.h | tar -x -C dir`), rebuilt
# incrementally; the Python package is the checkout's for both. Alternates before, after,
# before, after, so that drift hits both. For changes under csrc/ and python/.
#   ZERO_ARGS: bench_zero.py arguments (torchrun over every GPU)
#   ROUNDS:    how many times each runs (default 2)
# Logs go to $OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
BEFORE_SRC=$(cd "${BEFORE_SRC:?BEFORE_SRC=dir holding the baseline files by their paths in the tree}" && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
SKIP_TESTS=1 BENCH=0 bash test/gpu/run_on_gpu_machine.sh || exit 1
SO=$(ls horovod_zero/_core*.so)
keep=$(mktemp -d)
cp "$SO" "$keep/after.so"
(cd "$BEFORE_SRC" && find . -type f) > "$keep/files"
while read -r f; do mkdir -p "$keep/tree/$(dirname "$f")"; cp "$f" "$keep/tree/$f"; cp "$BEFORE_SRC/$f" "$f"; done < "$keep/files"
(cd build/cmake && ninja > "$OUT/ab_native_build.log" 2>&1) || { tail -20 "$OUT/ab_native_build.log"; exit 1; }
cp "$SO" "$keep/before.so"
while read -r f; do cp "$keep/tree/$f" "$f"; done < "$keep/files"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for round in $(seq "${ROUNDS:-2}"); do
  for side in before after; do
    cp "$keep/$side.so" "$SO"
    echo "== $side"
    PYTHONPATH="$ROOT:$ROOT/examples" timeout 300 python3 -m torch.distributed.run --nproc_per_node="$GPUS" \
      --master_port="$(free_port)" examples/bench_zero.py ${ZERO_ARGS:?} 2>&1 | grep -v "^W1\|OMP_NUM" \
      | tee -a "$OUT/ab_native_$side.log" | tail -4
  done
done
cp "$keep/after.so" "$SO"
