"""examples/trace_kernels.py: kernel time per step of a trace against the floor's, on
synthetic traces (the real ones come from bench_zero --trace-dir on a GPU)."""

import gzip
import json
import os
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import trace_kernels as tk  # noqa: E402


def _kernel(name, dur, device=0):
    return {"cat": "kernel", "name": name, "ts": 0, "dur": dur, "args": {"device": device, "stream": 7}}


def _floor():
    return [_kernel("gemm", 900), _kernel("gemm", 900), _kernel("softmax", 300)]


def _mode():
    """Two steps: gemms slowed beside NCCL, an allgather per step whose calls differ only
    in their arguments, and another GPU's kernels, which are not this rank's."""
    ev = [_kernel("gemm", 1000) for _ in range(4)] + [_kernel("softmax", 300) for _ in range(2)]
    ev += [_kernel(f"ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs{n})", 500) for n in range(2)]
    return ev + [_kernel("gemm", 1e6, device=1)]


def test_differences_per_step_by_kernel_largest_first():
    base = tk.per_step(_floor(), steps=1)
    mode = tk.per_step(_mode(), steps=2)
    assert mode["nccl:ncclDevKernel_AllGather_RING_LL"] == (0.5, 1.0)  # one key for both calls
    rows = tk.differences(base, mode)
    assert [(round(d, 3), k) for d, k, _, _ in rows] == [(0.5, "nccl:ncclDevKernel_AllGather_RING_LL"),
                                                          (0.2, "gemm"), (0.0, "softmax")]
    assert rows[1][2] == (2.0, 2.0) and rows[1][3] == (1.8, 2.0)


def test_the_command_prints_each_trace_against_the_first(tmp_path):
    paths = []
    for name, ev in (("floor", _floor()), ("mode", _mode())):
        p = tmp_path / f"trace_{name}.json.gz"
        with gzip.open(p, "wt") as f:
            json.dump({"traceEvents": ev}, f)
        paths.append(str(p))
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "trace_kernels.py"), *paths, "--steps", "1"],
                         capture_output=True, text=True, check=True).stdout
    # Read as one step: 4.0 ms of gemms, 0.6 of softmax and 1.0 of allgathers against 2.1 ms.
    assert "+3.50 ms of kernel time per step" in out, out
    assert [line.split()[0] for line in out.splitlines()[1:4]] == ["+2.20", "+1.00", "+0.30"], out
