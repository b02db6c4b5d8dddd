#!/usr/bin/env bash
# On the 1-GPU machine (the device tool, carry build/deps/deepspeed from test/gpu/deepspeed_deps.sh):
# builds horovod_zero unless a CUDA build is importable, sets DeepSpeed up (deepspeed_env.sh) and
# compiles its ops once (kept in build/torch_extensions on a warm machine), then runs
# examples/bench_offload.py on a preset within one device call; logs and JSON lines go to $OUT.
#   PRESET=fast   ddp, zero2-cpu-fwd, zero2-cpu, zero2-cpu-serial, ds2-offload, zero3-cpu-fwd, zero3-cpu,
#                 ds3-offload, fsdp2-cpu
#   PRESET=ours   ddp, zero2-cpu-fwd, zero2-cpu, zero2-cpu-serial, zero3-cpu-fwd, zero3-cpu
#   PRESET=peers  ds2-offload, ds3-offload, fsdp2-cpu
#                 (ours and peers: fast split in two, if one call is too short; bench_offload.py
#                 --modes "" --merge A.jsonl B.jsonl joins the tables)
#   PRESET=nvme   zero3-nvme, ds3-nvme and the disk floor, on NVME_PATH (default build/nvme; >= 30 GB free)
# MODES overrides the preset's modes, SKIP_BUILD=1 uses the build there is (REBUILD=1: builds anyway),
# PYTHON the interpreter, BENCH_ARGS adds options (e.g. "--layers 24"), BUDGET (s, default
# 570) bounds the whole call: modes that would not finish in it are reported as skipped.
set -uo pipefail
t_start=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
cd "$ROOT" || exit 1
PRESET=${PRESET:-fast}
BUDGET=${BUDGET:-570}
NVME_PATH=${NVME_PATH:-$ROOT/build/nvme}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset OMP_NUM_THREADS  # the CPU optimizers use every core

case $PRESET in
  fast)  modes=ddp,zero2-cpu-fwd,zero2-cpu,zero2-cpu-serial,ds2-offload,zero3-cpu-fwd,zero3-cpu,ds3-offload,fsdp2-cpu ;;
  ours)  modes=ddp,zero2-cpu-fwd,zero2-cpu,zero2-cpu-serial,zero3-cpu-fwd,zero3-cpu ;;
  peers) modes=ds2-offload,ds3-offload,fsdp2-cpu ;;
  nvme)  modes=disk-floor,zero3-nvme,ds3-nvme ;;
  *) echo "run_offload_bench: PRESET must be fast, ours, peers or nvme" >&2; exit 2 ;;
esac
modes=${MODES:-$modes}
timeouts="ddp=120,zero2-cpu=150,zero2-cpu-fwd=150,zero2-cpu-serial=150,zero3-cpu=180,zero3-cpu-fwd=180,ds2-offload=240,ds3-offload=240,fsdp2-cpu=150"
timeouts="$timeouts,disk-floor=90,zero3-nvme=300,ds3-nvme=360"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null | head -1
"$PY" -c 'import sys; print("python", sys.version.split()[0])'

if [ "${REBUILD:-0}" = 1 ] || { [ "${SKIP_BUILD:-0}" != 1 ] \
     && ! "$PY" -c 'import sys, horovod_zero.torch as h; sys.exit(0 if h.cuda_built() else 1)' 2> /dev/null; }; then
  # The compiler whose libstdc++ python and torch load (see run_on_gpu_machine.sh).
  if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
  # liburing for the NVMe modes: the copy test/gpu/liburing_deps.sh made, carried to the machine.
  if [ -d "$ROOT/build/deps/liburing" ]; then export HVDZ_LIBURING_ROOT=$ROOT/build/deps/liburing; fi
  t0=$(date +%s)
  rm -rf build/cmake
  HVDZ_CMAKE_ARGS="-DHVDZ_BUILD_TESTS=OFF -DHVDZ_CUDA=ON" HVDZ_BUILD_JOBS=$(nproc) bash examples/build.sh "$PY" \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "horovod_zero build: $(( $(date +%s) - t0 )) s"
fi

# After the build: deepspeed_env.sh sets TORCH_CUDA_ARCH_LIST and CFLAGS for DeepSpeed's ops only.
if [[ $modes == *ds* ]]; then
  if source test/gpu/deepspeed_env.sh; then
    ops="CPUAdamBuilder"; [[ $modes == *ds3-nvme* ]] && ops="$ops AsyncIOBuilder"
    for op in $ops; do
      t0=$(date +%s)
      if "$PY" -c "from deepspeed.ops.op_builder import $op; $op().load()" > "$OUT/ds_op_$op.log" 2>&1; then
        echo "DeepSpeed $op ready: $(( $(date +%s) - t0 )) s (just-in-time compile, or the cached build)"
      else
        echo "DeepSpeed $op failed to build; its modes will fail:"; tail -15 "$OUT/ds_op_$op.log"
      fi
    done
  else
    echo "DeepSpeed is not set up: its modes will be skipped"
  fi
fi

nvme_args=()
if [[ $modes == *nvme* || $modes == *disk-floor* ]]; then
  mkdir -p "$NVME_PATH"
  free_gb=$(( $(df --output=avail -B1 "$NVME_PATH" | tail -1) / 1000000000 ))
  echo "NVMe path $NVME_PATH: $free_gb GB free ($(df --output=source,fstype "$NVME_PATH" | tail -1 | tr -s ' '))"
  if [ "$free_gb" -ge 30 ]; then
    nvme_args=(--nvme-path "$NVME_PATH")
  else
    echo "NVMe modes skipped: $NVME_PATH has $free_gb GB free, they need 30 GB (set NVME_PATH)"
  fi
fi

left=$(( BUDGET - ($(date +%s) - t_start) ))
echo "bench_offload: PRESET=$PRESET modes $modes, $left s left of BUDGET=$BUDGET"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
"$PY" examples/bench_offload.py --modes "$modes" --timeout "$timeouts" --budget "$left" "${nvme_args[@]}" \
  --json "$OUT/offload_$PRESET.jsonl" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/offload_$PRESET.log" | grep -v "^  \[.*\] \(W1\|\[W\)"
