#!/usr/bin/env bash
# On a GPU machine after run_on_gpu_machine.sh built horovod_zero (same call, or a warm
# machine): examples/bench_elastic.py under horovodrun's elastic driver, one worker per GPU
# (NPROC workers on CPU), each on a host name of its own for
# this machine (localhost, 127.0.0.1, the hostname, its addresses), so that the SIGKILL of one
# worker blacklists that worker alone: N ranks -> N-1. ELASTIC_ARGS go to the benchmark.
# Events go to $OUT/elastic.*.jsonl, the launcher's output to $OUT/elastic.log; a summary is printed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hvdz_out}; mkdir -p "$OUT"
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 OUT
export PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}"
# Horovod's launcher, where test/gpu/horovod_deps.sh left it (the GPU machine has no network).
if [ -d "$ROOT/build/deps/horovod_site" ]; then export PYTHONPATH="$PYTHONPATH:$ROOT/build/deps/horovod_site"; fi
PY=${PYTHON:-python3}
N=${NPROC:-$($PY -c 'import torch; print(torch.cuda.device_count() or 2)')}  # a worker per GPU
names=()
for h in localhost 127.0.0.1 "$(hostname)" $(hostname -I 2>/dev/null); do
  [[ " ${names[*]} " == *" $h "* ]] || names+=("$h")
done
hosts="$OUT/elastic_hosts.txt"; : > "$hosts"
for ((i = 0; i < N; i++)); do echo "${names[$((i % ${#names[@]}))]}"; done | sort | uniq -c \
  | awk '{print $2 ":" $1}' > "$hosts"
printf '#!/bin/sh\ncat %s\n' "$hosts" > "$OUT/elastic_hosts.sh"; chmod +x "$OUT/elastic_hosts.sh"
echo "hosts: $(tr '\n' ' ' < "$hosts")"
rm -f "$OUT"/elastic.*.jsonl
timeout "${ELASTIC_TIMEOUT:-400}" $PY -m horovod_zero.runner -np "$N" --min-np 1 --max-np "$N" \
  --host-discovery-script "$OUT/elastic_hosts.sh" --network-interface lo \
  $PY examples/bench_elastic.py ${ELASTIC_ARGS:-} > "$OUT/elastic.log" 2>&1
echo "launcher exit: $?"
$PY - "$OUT" <<'PYEOF'
import glob, json, sys
rows = sorted((json.loads(l) for f in glob.glob(sys.argv[1] + "/elastic.*.jsonl") for l in open(f)), key=lambda r: r["t"])
kill = next((r for r in rows if r["event"] == "kill"), None)
commits = [r["seconds"] for r in rows if r["event"] == "commit"]
if commits:
    print(f"commit: median {sorted(commits)[len(commits) // 2]:.2f} s over {len(commits)} (all ranks)")
for e in ("dcp save", "dcp load"):
    xs = [r["seconds"] for r in rows if r["event"] == e]
    if xs:
        print(f"{e}: {max(xs):.2f} s (slowest rank)")
if kill:
    before = [r["step"] for r in rows if r["event"] == "step" and r["t"] < kill["t"]]
    print(f"kill: first rank {kill['first_rank']} in step {max(before) + 1}, job of {kill['size']}")
    after = [r for r in rows if r["t"] > kill["t"]]
    for e in ("failure seen", "job formed and optimizer rebuilt", "state restored", "step"):
        xs = [r for r in after if r["event"] == e]
        if xs:
            last = max(xs, key=lambda r: r["t"]) if e != "step" else min(xs, key=lambda r: r["t"])
            if e == "step":  # the first step after: its slowest rank
                last = max((r for r in xs if r["step"] == last["step"]), key=lambda r: r["t"])
            print(f"kill -> {e}: {last['t'] - kill['t']:.2f} s (slowest rank, job of {last['size']})")
PYEOF
