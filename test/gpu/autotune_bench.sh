#!/usr/bin/env bash
# HOROVOD_AUTOTUNE on the GPUs, against the default settings. For each benchmark in WHAT:
#   default  the default settings;
#   tuned    HOROVOD_AUTOTUNE=1: trains (or runs the collectives) untimed until the tuner
#            keeps its best setting, then times with it; its log is $OUT/autotune_<bench>.csv;
#   kept     the kept setting (the log's last row) given as variables, tuner off, as
#            Horovod's docs suggest for later runs;
#   default  again, so that drift between runs shows.
#   WHAT:      any of zero2, zero3, collectives (default: all three)
#   ZERO_ARGS: more bench_zero.py arguments (default: --micro-batch 1 --steps 30 --extras none)
#   COLL_ARGS: bench_collectives.py arguments (default: --totals 64MiB,1GiB)
#   TUNE:      HOROVOD_AUTOTUNE_* settings of the tuned run (default: 5 steps per sub-sample, so
#              (3 + 20 + 2 x 3 confirmation rounds) samples x 5 sub-samples x 5 steps: 725 tensor
#              repeats; Horovod's 10 doubles it)
# SKIP_BUILD=1 reuses a warm machine's build. Logs go to $OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  SKIP_TESTS=1 BENCH=0 bash test/gpu/run_on_gpu_machine.sh || exit 1
fi
GPUS=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The last row of an autotune log (the setting kept) as variables.
kept_env() {
  python3 - "$1" <<'EOF'
import csv, sys
row = list(csv.DictReader(open(sys.argv[1])))[-1]
mib = lambda x: str(round(float(x)) << 20)
print(f"HOROVOD_FUSION_THRESHOLD={mib(row['tensor_fusion_threshold'])} HOROVOD_CYCLE_TIME={row['cycle_time_ms']} "
      f"HOROVOD_ZERO_BUCKET_BYTES={mib(row['zero_bucket_mb'])} HOROVOD_ZERO_PREFETCH={row['zero_prefetch']}")
EOF
}
bench() {  # bench name, label, env, then the script and its arguments
  local name=$1 label=$2 vars=$3; shift 3
  echo "== $name $label ${vars}"
  env $vars timeout 600 python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$(free_port)" "$@" \
    2>&1 | grep -v "^W1\|OMP_NUM" | tee -a "$OUT/autotune_bench_$name.log" | tail -6
}
for what in ${WHAT:-zero2 zero3 collectives}; do
  if [ "$what" = collectives ]; then
    args=(examples/bench_collectives.py ${COLL_ARGS:---totals 64MiB,1GiB})
  else
    args=(examples/bench_zero.py --modes "$what" ${ZERO_ARGS:---micro-batch 1 --steps 30 --extras none})
  fi
  log=$OUT/autotune_$what.csv
  bench "$what" default "" "${args[@]}"
  bench "$what" tuned "HOROVOD_AUTOTUNE=1 HOROVOD_AUTOTUNE_LOG=$log ${TUNE:-HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=5}" "${args[@]}"
  [ -s "$log" ] && cat "$log" && bench "$what" kept "$(kept_env "$log")" "${args[@]}"
  bench "$what" default "" "${args[@]}"
done
