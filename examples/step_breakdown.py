"""Where a training step's time goes, from a profile of a few steps: the GPU timeline cut
into disjoint parts that add up to the step.

    optimizer   some kernel launched by optimizer.step() (or zero_grad()) runs
    compute     another non-communication kernel (or copy) runs, and no optimizer one
    exposed     only communication runs (NCCL's kernels, copies between GPUs): nothing hides it
    idle        nothing runs: the GPU waits for the host (hooks, launches, waits, syncs)

`hidden` is the communication time that overlaps compute, reported apart. Comparing
`compute` with the same forward and backward measured alone (the floor) gives what
running beside communication and ZeRO's own kernels (casts, copies, recompute) costs.
"""

import gzip
import json
import os
import tempfile
import time
from collections import Counter

from torch.profiler import ProfilerActivity, profile

OPTIMIZER_MARK = "bench.optimizer_step"
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def is_comm(name):
    """NCCL's kernels, and copies from one GPU to another: NCCL's copy-engine collectives
    (HOROVOD_ZERO_CE_ALLGATHER_BYTES) run as peer-to-peer memcpys, with no kernel."""
    return "nccl" in name.lower() or name.startswith("Memcpy PtoP")


def load_events(path):
    """The events of a Chrome trace, gzipped (as profile_parts keeps them) or not."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return json.load(f)["traceEvents"]


def busiest_gpu_events(events):
    """The GPU events of a Chrome trace on the device that ran most of them (a rank's
    own GPU; a trace may show others'), or [] when it has none."""
    on_gpu = [e for e in events if e.get("cat") in _GPU_CATS and e.get("dur", 0) > 0]
    if not on_gpu:
        return []
    device = Counter(e.get("args", {}).get("device") for e in on_gpu).most_common(1)[0][0]
    return [e for e in on_gpu if e.get("args", {}).get("device") == device]


def kernel_intervals(events, mark=OPTIMIZER_MARK):
    """[(start_us, end_us, kind)] of a Chrome trace's GPU events, kind one of "comm",
    "optimizer", "compute". A kernel is the optimizer's when the host thread that ran the
    `mark` range launched it inside that range (matched through the launch's correlation
    id); communication is any NCCL kernel or peer-to-peer copy, whoever launched it."""
    marks = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events
             if e.get("cat") == "user_annotation" and e.get("name") == mark]
    in_step = set()
    for e in events:
        if e.get("cat") in _LAUNCH_CATS and any(tid == e["tid"] and s <= e["ts"] <= t for s, t, tid in marks):
            in_step.add(e["args"]["correlation"])
    out = []
    for e in events:
        if e.get("cat") not in _GPU_CATS or e.get("dur", 0) <= 0:
            continue
        kind = "comm" if is_comm(e["name"]) else \
            "optimizer" if e.get("args", {}).get("correlation") in in_step else "compute"
        out.append((e["ts"], e["ts"] + e["dur"], kind))
    return out


def partition(intervals):
    """Total time (same unit as the intervals) in which: an optimizer kernel runs
    ("optimizer"); another compute kernel runs and no optimizer one ("compute"); only
    communication runs ("exposed"); communication runs beside compute ("hidden"); and the
    span from the first start to the last end with nothing running ("idle")."""
    out = dict(optimizer=0.0, compute=0.0, exposed=0.0, hidden=0.0, idle=0.0)
    if not intervals:
        return out
    edges = sorted([(s, 1, k) for s, _, k in intervals] + [(e, -1, k) for _, e, k in intervals],
                   key=lambda x: (x[0], x[1]))  # ends before starts at one instant
    running = dict(optimizer=0, compute=0, comm=0)
    last = edges[0][0]
    for t, delta, kind in edges:
        span = t - last
        if span > 0:
            busy = running["optimizer"] or running["compute"]
            if running["optimizer"]:
                out["optimizer"] += span
            elif running["compute"]:
                out["compute"] += span
            elif running["comm"]:
                out["exposed"] += span
            else:
                out["idle"] += span
            if busy and running["comm"]:
                out["hidden"] += span
        running[kind] += delta
        last = t
    return out


def profile_parts(step_fn, steps, sync, keep=None, back_to_back=False):
    """partition() of `steps` calls of step_fn (each followed by sync(), as the timing
    does; `back_to_back`: one sync() after the last, as training runs them, so that what
    a step leaves running overlaps the next one), and their wall time ("wall"), per step,
    in seconds. The profiler slows the host
    (most where the host sets the pace), so the parts add up to the profiled wall time,
    not to an unprofiled step's. Every rank profiles; the trace is kept gzipped at `keep`
    when given (chrome://tracing and Perfetto read it)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn()
            if not back_to_back:
                sync()
        if back_to_back:
            sync()
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
        if keep:
            with gzip.open(keep, "wb") as f:
                f.write(raw)
        events = json.loads(raw)["traceEvents"]
    finally:
        os.unlink(path)
    parts = {k: v / steps / 1e6 for k, v in partition(kernel_intervals(events)).items()}
    parts["wall"] = wall / steps
    return parts


def busy(parts):
    """GPU time in which something runs (any of the disjoint parts but idle)."""
    return parts["optimizer"] + parts["compute"] + parts["exposed"]

