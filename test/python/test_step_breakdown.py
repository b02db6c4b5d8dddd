"""examples/step_breakdown.py: the GPU timeline cut into disjoint parts, on synthetic
intervals and traces (the CUDA run is test/gpu/test_gpu_breakdown.py), and the trace
fields it reads, from a real CPU profile."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import step_breakdown as sb  # noqa: E402


def test_parts_are_disjoint_and_add_up_to_the_span():
    intervals = [(0, 10, "compute"), (5, 15, "comm"),     # comm hidden 5..10, exposed 10..15
                 (20, 25, "optimizer"), (22, 30, "compute"),  # idle 15..20; optimizer wins 22..25
                 (24, 26, "comm")]                            # hidden under both
    got = sb.partition(intervals)
    assert got == dict(optimizer=5, compute=15, exposed=5, hidden=7, idle=5)
    assert sb.busy(got) + got["idle"] == 30


def test_touching_intervals_leave_no_idle_and_an_empty_timeline_is_all_zero():
    assert sb.partition([(0, 4, "comm"), (4, 9, "compute")]) == dict(optimizer=0, compute=5, exposed=4, hidden=0,
                                                                      idle=0)
    assert sb.partition([]) == dict(optimizer=0.0, compute=0.0, exposed=0.0, hidden=0.0, idle=0.0)


def _launch(tid, ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts, "dur": 1, "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "tid": 7, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_a_kernel_is_the_optimizers_when_the_marked_thread_launched_it_inside_the_mark():
    events = [
        {"cat": "user_annotation", "name": sb.OPTIMIZER_MARK, "tid": 1, "ts": 100, "dur": 100},
        _launch(1, 150, 1), _kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 300, 5, 1),
        _launch(2, 150, 2), _kernel("copy_kernel", 310, 5, 2),          # another thread, same time
        _launch(1, 250, 3), _kernel("gemm", 320, 5, 3),                 # same thread, after the mark
        _launch(1, 160, 4), _kernel("ncclDevKernel_AllGather_RING_LL", 330, 5, 4),  # communication first
        {"cat": "gpu_memset", "name": "Memset", "tid": 7, "ts": 340, "dur": 2, "args": {"correlation": 5}},
        {"cat": "kernel", "name": "empty", "tid": 7, "ts": 350, "dur": 0, "args": {"correlation": 6}},
    ]
    assert sb.kernel_intervals(events) == [(300, 305, "optimizer"), (310, 315, "compute"), (320, 325, "compute"),
                                           (330, 335, "comm"), (340, 342, "compute")]


def test_copies_between_gpus_are_communication_and_copies_on_one_are_not():
    # NCCL's copy-engine allgather runs as peer-to-peer memcpys, with no kernel.
    events = [
        {"cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "tid": 7, "ts": 10, "dur": 4,
         "args": {"correlation": 1}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "tid": 7, "ts": 20, "dur": 3,
         "args": {"correlation": 2}},
    ]
    assert sb.kernel_intervals(events) == [(10, 14, "comm"), (20, 23, "compute")]


def test_torch_traces_carry_the_fields_the_breakdown_reads(tmp_path):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(sb.OPTIMIZER_MARK):
            torch.ones(4).add_(1)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    marks = [e for e in json.loads(path.read_text())["traceEvents"]
             if e.get("cat") == "user_annotation" and e.get("name") == sb.OPTIMIZER_MARK]
    assert len(marks) == 1 and {"ts", "dur", "tid"} <= marks[0].keys()


def test_back_to_back_profiling_synchronizes_once_after_the_steps_instead_of_after_each():
    """Synchronized after each step, a step that leaves work queued (overlap_param_gather's
    gathers) is profiled without its overlap with the next forward."""
    syncs = []
    steps_run = []

    def step():
        steps_run.append(len(syncs))  # how many syncs came before this step began
    sb.profile_parts(step, 3, lambda: syncs.append(1))
    assert steps_run == [1, 2, 3] and len(syncs) == 4  # before, and after each step
    syncs.clear()
    steps_run.clear()
    parts = sb.profile_parts(step, 3, lambda: syncs.append(1), back_to_back=True)
    assert steps_run == [1, 1, 1] and len(syncs) == 2
    assert parts["wall"] > 0
