"""Host time in CUDA runtime and driver calls per step, by thread and call, of profiler
traces (bench_zero --breakdown --trace-dir's; three profiled steps each unless --steps
says otherwise): whether a mode's launches cost the host more than the floor's, and
which thread makes them (the Python thread, autograd's, or the runtime's own).

    python examples/trace_api.py tr/trace_floor.json.gz tr/trace_zero2.json.gz [--top 8]

Per trace and thread: calls and ms per step; then its costliest calls, with the mean
and median duration of one call in us.
"""
import argparse
import statistics
from collections import defaultdict

from step_breakdown import _LAUNCH_CATS, load_events


def api_calls(events):
    """{thread id: {call name: [durations in us]}} of the trace's CUDA API events."""
    out = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("cat") in _LAUNCH_CATS and e.get("ph") == "X":
            out[e.get("tid")][e["name"]].append(float(e.get("dur", 0)))
    return out


def report(path, steps, top):
    by_thread = api_calls(load_events(path))
    lines = [f"== {path}"]
    ranked = sorted(by_thread.items(), key=lambda kv: -sum(sum(d) for d in kv[1].values()))
    for tid, calls in ranked:
        total = sum(sum(d) for d in calls.values())
        n = sum(len(d) for d in calls.values())
        lines.append(f"  thread {tid}: {n / steps:.0f} calls, {total / 1e3 / steps:.2f} ms per step")
        for name, durs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"    {name:<40} {len(durs) / steps:7.1f} calls {sum(durs) / 1e3 / steps:7.2f} ms"
                         f"  mean {statistics.fmean(durs):6.1f} us  median {statistics.median(durs):6.1f} us")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in each trace")
    ap.add_argument("--top", type=int, default=8, help="calls listed per thread")
    args = ap.parse_args()
    for path in args.traces:
        print(report(path, args.steps, args.top))


if __name__ == "__main__":
    main()
