"""examples/trace_comm.py: NCCL occupancy, exposed time and launch leads, on a
synthetic two-GPU trace (the real ones come from bench_zero --trace-dir on a GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import trace_comm as tc  # noqa: E402


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr, device=1):
    return {"cat": "kernel", "name": name, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "device": device}}


def test_occupancy_exposed_time_and_leads_of_the_busiest_gpu():
    events = [
        _launch(0, 1), _kernel("gemm", 100, 400, 1),                 # compute 100..500
        _launch(50, 2), _kernel("ncclDevKernel_AllGather", 300, 400, 2),  # 300..700: exposed 500..700, lead 250
        _launch(990, 3), _kernel("ncclDevKernel_ReduceScatter", 1000, 200, 3),  # launched 10 us before: late
        _launch(1100, 4), _kernel("gemm", 1150, 50, 4),               # hides 1150..1200 of it
        _kernel("ncclDevKernel_AllGather", 0, 5000, 9, device=0),   # another GPU's: not this rank's
    ]
    s = tc.comm_summary(events)
    assert s["window"] == 1100  # 100..1200
    assert s["comm_busy"] == 600
    assert s["exposed"] == 200 + 150
    assert s["collectives"] == 2 and sorted(s["leads"]) == [10, 250]
    line = tc.describe("t", s)
    assert "launched late 50%" in line and "comm busy 0.6 ms (55%)" in line


def test_overlapping_collectives_count_once_and_no_gpu_events_say_so():
    events = [_launch(0, 1), _kernel("ncclDevKernel_AllGather", 0, 10, 1), _launch(0, 2),
              _kernel("ncclDevKernel_ReduceScatter", 5, 7, 2), _launch(0, 3), _kernel("ncclDevKernel_AllGather", 20, 5, 3),
              _launch(0, 4), _kernel("ncclDevKernel_AllGather", 21, 1, 4)]
    s = tc.comm_summary(events)
    assert s["comm_busy"] == 17 and s["exposed"] == 17 and s["window"] == 25
    assert tc.comm_summary([_launch(0, 1)]) is None
    assert tc.describe("t", None) == "t: no GPU events"


def test_without_paths_it_prints_its_use(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trace_comm.py"])
    with pytest.raises(SystemExit, match="Is the communication late or slow"):
        exec(compile(open(tc.__file__).read(), tc.__file__, "exec"), {"__name__": "__main__"})
