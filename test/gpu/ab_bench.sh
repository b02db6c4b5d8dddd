#!/usr/bin/env bash
# A/B benchmark of the Python package: the checkout against a baseline tree of
# horovod_zero/ (BEFORE=dir holding horovod_zero/, e.g. made with
# `git archive <commit> horovod_zero | tar -x -C dir`), both on the C++ extension the
# checkout built (SKIP_BUILD=1 reuses a warm machine's), alternating A, B, A, B so that
# drift hits both. For changes that leave csrc/ alone.
#   ZERO_ARGS:    bench_zero.py arguments (torchrun over every GPU); empty skips it
#   OFFLOAD_ARGS: bench_offload.py arguments (one GPU); empty skips it
#   ROUNDS:       how many times each runs (default 2)
# Logs go to $OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
BEFORE=$(cd "${BEFORE:?BEFORE=dir holding the baseline horovod_zero/}" && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  SKIP_TESTS=1 BENCH=0 bash test/gpu/run_on_gpu_machine.sh || exit 1
fi
cp horovod_zero/_core*.so "$BEFORE/horovod_zero/"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
run() {  # label, package root, then the command
  local label=$1 pkg=$2; shift 2
  echo "== $label"
  PYTHONPATH="$pkg:$ROOT/examples" "$@" 2>&1 | grep -v "^W1\|OMP_NUM" | tee -a "$OUT/ab_$label.log" | tail -8
}
for round in $(seq "${ROUNDS:-2}"); do
  for side in before after; do
    pkg=$ROOT; [ "$side" = before ] && pkg=$BEFORE
    if [ -n "${ZERO_ARGS:-}" ]; then
      run "zero_$side" "$pkg" timeout 300 python3 -m torch.distributed.run --nproc_per_node="$GPUS" \
        --master_port="$(free_port)" examples/bench_zero.py $ZERO_ARGS
    fi
    if [ -n "${OFFLOAD_ARGS:-}" ]; then
      run "offload_$side" "$pkg" timeout 300 env OMP_NUM_THREADS="$(nproc)" python3 examples/bench_offload.py $OFFLOAD_ARGS
    fi
  done
done
