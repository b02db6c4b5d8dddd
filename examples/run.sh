#!/usr/bin/env bash
# The main job: set up (examples/setup.sh) and train a small language model with
# ZeRO stage 2 (DistributedZeroOptimizer) over 2 ranks, on CPU when there is no GPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=$(bash "$ROOT/examples/setup.sh" | tail -n 1)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="${NPROC:-2}" --master_port="$port" \
  examples/train_zero.py "$@"
