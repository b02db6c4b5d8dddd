"""What runs between one step's backward and the next forward, per CUDA stream, from a
profiler trace of bench_zero --breakdown --trace-dir: the reductions still running, the
optimizer's kernels, the parameter gathers and the copies, merged into segments.

    python examples/trace_tail.py traces/trace_zero2.rank0.json.gz [--span-ms 15]

Each profiled step prints the segments from 1 ms before backward's last kernel (the
last compute kernel that started before the step's first optimizer kernel) to
--span-ms after it, in ms from that kernel's end, and when the next forward's first
kernel on the compute stream started.
"""
import argparse
from collections import Counter

from step_breakdown import _GPU_CATS, busiest_gpu_events, kernel_intervals, load_events

GAP_US = 20.0  # kernels of one kind on one stream closer than this form one segment


def kind_of(name, optimizer):
    low = name.lower()
    if "allgather" in low:
        return "allgather"
    if "reducescatter" in low:
        return "reduce-scatter"
    if "nccl" in low:
        return "nccl"
    if name.startswith("Memcpy PtoP"):
        return "copy-engine"
    if optimizer:
        return "optimizer"
    if "batched" in low or "copy" in low or "cast" in low or "memcpy" in low or "memset" in low:
        return "copy"
    return "compute"


def tails(events, span_us):
    """[(t0, segments, next_forward)] per step: segments [(stream, start, end, kind, n)]
    relative to t0 (backward's last kernel end), in microseconds."""
    gpu = busiest_gpu_events(events)
    # kernel_intervals() keeps the GPU events' order: its first len(gpu) rows are theirs.
    kinds = kernel_intervals(gpu + [e for e in events if e.get("cat") not in _GPU_CATS])
    rows = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream"), kind_of(e["name"], k == "optimizer"))
                  for e, (_, _, k) in zip(gpu, kinds))
    compute_stream = Counter(r[2] for r in rows if r[3] == "compute").most_common(1)[0][0]
    firsts = []  # each step's first optimizer kernel
    for r in rows:
        if r[3] == "optimizer" and (not firsts or r[0] - firsts[-1] > 20e3):
            firsts.append(r[0])
    out = []
    for first in firsts:
        before = [r for r in rows if r[3] == "compute" and r[2] == compute_stream and r[0] < first]
        if not before:
            continue
        t0 = before[-1][1]
        last_opt = max(r[1] for r in rows if r[3] == "optimizer" and first <= r[0] < first + 50e3)
        nxt = [r[0] for r in rows if r[3] == "compute" and r[2] == compute_stream and r[0] > last_opt]
        segs = []
        for s, e, stream, kind in rows:
            if e < t0 - 1e3 or s > t0 + span_us:
                continue
            last = next((g for g in reversed(segs) if g[0] == stream), None)
            if last and last[3] == kind and s - last[2] < GAP_US:
                last[2] = max(last[2], e)
                last[4] += 1
            else:
                segs.append([stream, s, e, kind, 1])
        out.append((t0, [(g[0], g[1] - t0, g[2] - t0, g[3], g[4]) for g in segs],
                    (nxt[0] - t0) if nxt else None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--span-ms", type=float, default=15.0)
    args = ap.parse_args()
    for path in args.traces:
        events = load_events(path)
        for n, (_, segs, nxt) in enumerate(tails(events, args.span_ms * 1e3)):
            when = f"{nxt / 1e3:.2f} ms" if nxt is not None else "not in the trace"
            print(f"{path}, step {n}: next forward's first kernel at {when}")
            for stream, s, e, kind, count in segs:
                print(f"  stream {stream}: {s / 1e3:7.2f} .. {e / 1e3:7.2f} ms  {kind} x{count}")


if __name__ == "__main__":
    main()
