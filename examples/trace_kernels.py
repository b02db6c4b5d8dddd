"""GPU time per step by kernel, of profiler traces against a first one (the floor's), the
largest differences first: which kernels a mode adds (collectives, the update, the
runtime's copies) and which of the model's own run slower beside them.

    python examples/trace_kernels.py tr/trace_floor.json.gz tr/trace_zero2_overlap.json.gz [...] [--top 20]

The traces are bench_zero --breakdown --trace-dir's (three profiled steps each, --steps
says otherwise); only the GPU that ran the most kernels in each trace is counted.
"""
import argparse
from collections import Counter

from step_breakdown import busiest_gpu_events, load_events


def kernel_key(name):
    """NCCL's kernels by their function (their arguments differ per call), others by name."""
    if "nccl" in name.lower():
        return "nccl:" + name.split("(")[0]
    return name


def per_step(events, steps):
    """{kernel: (ms per step, calls per step)} of the busiest GPU's events."""
    time, calls = Counter(), Counter()
    for e in busiest_gpu_events(events):
        k = kernel_key(e["name"])
        time[k] += e["dur"] / 1e3 / steps
        calls[k] += 1 / steps
    return {k: (time[k], calls[k]) for k in time}


def differences(base, other):
    """[(difference in ms per step, kernel, other's (ms, calls), base's (ms, calls))], largest first."""
    keys = set(base) | set(other)
    rows = [(other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], k, other.get(k, (0, 0)), base.get(k, (0, 0)))
            for k in keys]
    return sorted(rows, key=lambda r: -abs(r[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=3, help="steps in each trace")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    base = per_step(load_events(args.base), args.steps)
    for path in args.traces:
        other = per_step(load_events(path), args.steps)
        total = sum(t for t, _ in other.values()) - sum(t for t, _ in base.values())
        print(f"{path}: {total:+.2f} ms of kernel time per step against {args.base}")
        for diff, k, (t, n), (tb, nb) in differences(base, other)[:args.top]:
            print(f"  {diff:+7.2f} ms  ({t:6.2f} ms x{n:.0f} against {tb:6.2f} ms x{nb:.0f})  {k[:100]}")


if __name__ == "__main__":
    main()
