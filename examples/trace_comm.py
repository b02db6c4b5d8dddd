"""Is the communication late or slow? From the profiler traces of bench_zero --breakdown
(--trace-dir, with --trace-all-ranks one per rank), per trace:

    comm busy    the time some NCCL kernel runs, as a share of the traced window
    exposed      the time only NCCL kernels run (compute waits for them)
    lead         how long before it ran each collective was launched (median, and the
                 share launched under 0.1 ms before it ran)

Collectives launched well ahead and NCCL busy most of the window: the links set the pace,
and faster or fewer collectives would help. Collectives that run as soon as they are
launched: the GPU waits for the host, or for the slowest rank to submit, and the hooks
and waits are where to look.

    python examples/trace_comm.py traces/trace_zero3.rank*.json.gz
"""
import statistics
import sys

from step_breakdown import (_GPU_CATS, _LAUNCH_CATS, busiest_gpu_events, is_comm, kernel_intervals, load_events,
                            partition)

LATE_US = 100.0  # a collective launched less than this before it ran waited for its launch


def comm_summary(events):
    """For one rank's Chrome trace events (on the GPU that ran most of its kernels): the
    traced window, the time NCCL kernels run, the exposed time (only NCCL runs), and the
    lead of each collective (its start minus its launch on the host), in microseconds."""
    gpu = busiest_gpu_events(events)
    if not gpu:
        return None
    mine = [e for e in events if e.get("cat") not in _GPU_CATS] + gpu
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    comm = [e for e in gpu if is_comm(e["name"])]
    leads = [e["ts"] - launched[e["args"]["correlation"]] for e in comm
             if e.get("args", {}).get("correlation") in launched]
    window = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    # Only communication in the timeline: its "exposed" time is the time some collective runs.
    busy = partition([(e["ts"], e["ts"] + e["dur"], "comm") for e in comm])["exposed"]
    return dict(window=window, comm_busy=busy,
                exposed=partition(kernel_intervals(mine))["exposed"], collectives=len(comm), leads=leads)


def describe(name, s):
    if s is None:
        return f"{name}: no GPU events"
    late = sum(1 for x in s["leads"] if x < LATE_US) / len(s["leads"]) if s["leads"] else 0.0
    lead = statistics.median(s["leads"]) / 1e3 if s["leads"] else float("nan")
    return (f"{name}: window {s['window'] / 1e3:.1f} ms, comm busy {s['comm_busy'] / 1e3:.1f} ms "
            f"({s['comm_busy'] / s['window']:.0%}), exposed {s['exposed'] / 1e3:.1f} ms, "
            f"{s['collectives']} collectives, lead median {lead:.2f} ms, launched late {late:.0%}")


def main(paths):
    for path in paths:
        events = load_events(path)
        print(describe(path, comm_summary(events)))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
