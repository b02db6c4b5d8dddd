#!/usr/bin/env bash
# On a GPU machine with torch installed (no network needed): build horovod_zero
# from source, run the GPU tests, then the collective benchmarks on every GPU
# (BENCH=0 skips them) and the ZeRO benchmark runs listed in ZERO_BENCH.
# CPU_ONLY_BUILD=1 then rebuilds without CUDA and checks that it refuses CUDA tensors.
# SKIP_BUILD=1 uses the build a warm machine kept from an earlier call; SKIP_TESTS=1 skips the tests,
# GPU_TESTS names the test files to run (default: all of gpu/).
# DeepSpeed (for bench_zero's deepspeed3) is set up from build/deps/deepspeed when it was carried.
# Logs go to $OUT when it is set (the device tool's output folder).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Build with the compiler whose libstdc++ the process loads at run time: an
# image's newer CXX (seen: /opt/gcc) emits code for a newer libstdc++ than the
# system one python and torch use, and iostreams then crash inside the module.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
rm -rf build/cmake
# liburing for NVMe offload, where test/gpu/liburing_deps.sh left a copy (no apt here).
if [ -d "$ROOT/build/deps/liburing" ]; then export HVDZ_LIBURING_ROOT=$ROOT/build/deps/liburing; fi
HVDZ_CMAKE_ARGS="-DHVDZ_BUILD_TESTS=OFF -DHVDZ_CUDA=ON" HVDZ_BUILD_JOBS=$(nproc) bash examples/build.sh python3 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
fi
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # SIGABRT at the limit: pytest's faulthandler then prints where every thread was.
  (cd test && timeout -s ABRT -k 20 "${TEST_TIMEOUT:-400}" python3 -m pytest -q -ra ${GPU_TESTS:-gpu} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15) || rc=1
fi
if [ "${BENCH:-1}" = 1 ]; then
  port=$(free_port)
  HOROVOD_FUSION_THRESHOLD=${HOROVOD_FUSION_THRESHOLD:-2147483648} timeout 300 \
    python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$port" \
    examples/bench_collectives.py ${BENCH_ARGS:-} 2>&1 | grep -v "^W1\|OMP_NUM" | tee "$OUT/bench.log" | tail -12
  # The same benchmark again under other settings, to compare: ';'-separated env lists.
  IFS=';' read -ra alt_envs <<< "${BENCH_ALT_ENV:-}"
  for i in "${!alt_envs[@]}"; do
    port=$(free_port)
    env ${alt_envs[$i]} HOROVOD_FUSION_THRESHOLD=${HOROVOD_FUSION_THRESHOLD:-2147483648} timeout 300 \
      python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$port" \
      examples/bench_collectives.py ${BENCH_ARGS:-} 2>&1 | grep -v "^W1\|OMP_NUM" | tee "$OUT/bench_alt_$i.log" | tail -12
  done
  port=$(free_port)
  timeout 120 python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$port" \
    examples/bench_latency.py 2>&1 | grep -v "^W1\|OMP_NUM" | tee "$OUT/latency.log" | tail -6
fi
# ZeRO benchmark runs, ';'-separated argument lists for examples/bench_zero.py; their
# results also as rows in $OUT/bench_zero.jsonl (HVDZ_COMMIT names the commit in them).
IFS=';' read -ra zero_runs <<< "${ZERO_BENCH:-}"
if [ "${#zero_runs[@]}" -gt 0 ] && [ -f build/deps/deepspeed/VERSION ]; then
  source test/gpu/deepspeed_env.sh || echo "DeepSpeed not set up: its modes are skipped"
fi
for i in "${!zero_runs[@]}"; do
  port=$(free_port)
  PYTHONPATH="$ROOT/examples:$PYTHONPATH" timeout "${ZERO_BENCH_TIMEOUT:-300}" \
    python3 -m torch.distributed.run --nproc_per_node="$GPUS" --master_port="$port" \
    examples/bench_zero.py ${zero_runs[$i]} --jsonl "$OUT/bench_zero.jsonl" 2>&1 | grep -v "^W1\|OMP_NUM" | tee "$OUT/bench_zero_$i.log" | tail -14
done
if [ "${CPU_ONLY_BUILD:-0}" = 1 ]; then
  t0=$(date +%s)
  rm -rf build/cmake
  HVDZ_CMAKE_ARGS="-DHVDZ_BUILD_TESTS=OFF -DHVDZ_CUDA=OFF" HVDZ_BUILD_JOBS=$(nproc) bash examples/build.sh python3 \
    > "$OUT/build_cpu_only.log" 2>&1 || { tail -40 "$OUT/build_cpu_only.log"; exit 1; }
  echo "CPU-only build: $(( $(date +%s) - t0 )) s"
  (cd test && timeout 120 python3 -m pytest -q -ra gpu/test_cpu_only_build.py 2>&1 | tee "$OUT/cpu_only_tests.log" | tail -5) || rc=1
fi
exit $rc
