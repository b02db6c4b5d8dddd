"""The Chrome-trace events of a stretch of work under torch's profiler, for GPU
tests that check which kernels ran and when."""

import json
import os
import tempfile

import torch


def profiled_events(fn, device):
    """Runs fn() under the profiler (CPU and CUDA), synchronizing `device` after it,
    and returns the trace's events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
