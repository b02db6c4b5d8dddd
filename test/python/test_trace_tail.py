"""examples/trace_tail.py: what runs between backward and the next forward, on a
synthetic trace (the real ones come from bench_zero --trace-dir on a GPU)."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import trace_tail as tt  # noqa: E402


def _kernel(name, ts, dur, stream, corr=0, device=0):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": stream, "correlation": corr}}


def _step(t):
    """One step from t (us): backward's gemms on stream 7, a reduce-scatter on 20 still
    running after them, three optimizer kernels launched inside the mark, each followed by a
    cast and an allgather on 20, then the next forward's gemm."""
    ev = [_kernel("gemm", t + 100 * i, 90, 7) for i in range(10)]  # backward ends at t + 990
    ev.append(_kernel("ncclDevKernel_ReduceScatter_Sum_bf16", t + 1000, 2000, 20))
    ev.append({"cat": "user_annotation", "name": "bench.optimizer_step", "ts": t + 950, "dur": 500, "tid": 1})
    for i in range(3):
        corr = t + 100 + i
        ev.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 960 + 10 * i, "dur": 5, "tid": 1,
                   "args": {"correlation": corr}})
        ev.append(_kernel("multi_tensor_apply_kernel", t + 1100 + 300 * i, 280, 7, corr))
        ev.append(_kernel("BatchedCopyKernel<float, bf16>", t + 3000 + 500 * i, 40, 20))
        ev.append(_kernel("ncclDevKernel_AllGather_RING_LL", t + 3045 + 500 * i, 400, 20))
    ev.append(_kernel("gemm", t + 5000, 90, 7))  # the next forward
    return ev


def test_each_step_is_cut_at_backwards_end_into_segments_per_stream():
    events = _step(0) + _step(100_000) + [_kernel("gemm", 0, 1e6, 7, device=1)]  # another GPU's: ignored
    steps = tt.tails(events, span_us=4500)
    assert len(steps) == 2
    t0, segs, nxt = steps[0]
    assert t0 == 990 and nxt == 5000 - 990
    kinds = [(stream, kind, count) for stream, _, _, kind, count in segs]
    assert kinds[0] == (7, "compute", 10)  # the last ms of backward, merged
    assert (20, "reduce-scatter", 1) in kinds
    assert kinds.count((7, "optimizer", 1)) == 3  # 20 us apart: separate segments
    assert kinds.count((20, "copy", 1)) == 3 and kinds.count((20, "allgather", 1)) == 3
    rs = next(s for s in segs if s[3] == "reduce-scatter")
    assert (rs[1], rs[2]) == (10, 2010)
    assert all(s[1] <= 4500 for s in segs)  # nothing past the span


def test_the_command_prints_every_step(tmp_path, capsys, monkeypatch):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _step(0)}, f)
    monkeypatch.setattr(sys, "argv", ["trace_tail.py", "--span-ms", "5", str(path)])
    tt.main()
    out = capsys.readouterr().out
    assert "step 0: next forward's first kernel at 4.01 ms" in out
    assert "reduce-scatter x1" in out and "allgather x1" in out
