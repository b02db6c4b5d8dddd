#!/usr/bin/env bash
# On a GPU machine after run_on_gpu_machine.sh built horovod_zero (same call, or a warm
# machine): the large-model benchmarks. CKPT=1 runs examples/bench_checkpoint.py (the 1.2B
# model's DCP, async and consolidated checkpoints against FSDP2's DCP) on every GPU, with CKPT_ARGS;
# INIT_RUNS lists bench_init.py runs, ';'-separated, each "GPUS:args" (e.g.
# "2:--model 8b --system ours;1:--model 3b --system ours --offload"). Logs go to $OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ -f build/deps/deepspeed/VERSION ] && [[ "${INIT_RUNS:-}" == *deepspeed* ]]; then
  source test/gpu/deepspeed_env.sh || echo "DeepSpeed not set up: its runs fail"
fi
if [ "${CKPT:-0}" = 1 ]; then
  timeout "${CKPT_TIMEOUT:-400}" python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$(free_port)" \
    examples/bench_checkpoint.py --dir "${CKPT_DIR:-/tmp/hvdz_ckpt_bench}" ${CKPT_ARGS:-} 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" \
    | tee "$OUT/bench_checkpoint.log" | tail -12
fi
IFS=';' read -ra init_runs <<< "${INIT_RUNS:-}"
for i in "${!init_runs[@]}"; do
  n=${init_runs[$i]%%:*}; args=${init_runs[$i]#*:}
  timeout "${INIT_TIMEOUT:-300}" python3 -m torch.distributed.run --nproc_per_node="$n" --master_port="$(free_port)" \
    examples/bench_init.py $args 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tee "$OUT/bench_init_$i.log" | tail -4
done
