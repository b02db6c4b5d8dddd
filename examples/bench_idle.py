"""Idle cost and the latency of the first op after idle, on CPU ranks of one host.

    python examples/bench_idle.py [--ranks 2] [--control shm|gloo] [--idle 5] [--set]

Each rank inits, waits 1 s, then measures its process CPU time (every thread)
over --idle seconds of doing nothing. Then, several times, every rank idles for a
gap, rank 0 submits a small allreduce at an agreed wall-clock time and the other
ranks 20 ms later; the figure is how long after the last submission the op
completes on rank 0 (median and max over the repeats).

--set registers a process set of ranks 0 and 1 (run it with --ranks 3 or more):
the idle cost is then that of a job with process sets, and the op is an allreduce
in that set, which the ranks outside it, idle all along, must let through (see
[Note: process sets] in csrc/runtime/process_set.h).
"""

import argparse
import multiprocessing as mp
import os
import resource
import socket
import statistics
import time


GAPS = [0.05, 0.2, 0.5, 1.0, 2.0]  # seconds of idle before the op


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rank_main(rank, size, port, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      HOROVOD_ZERO_SHM_CONTROL="1" if args.control == "shm" else "0")
    import torch
    import horovod_zero.torch as hvd
    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[pair] if args.set else None)
    hvd.allreduce(torch.ones(4), name="warm")
    time.sleep(1.0)
    c0, w0 = cpu_seconds(), time.monotonic()
    time.sleep(args.idle)
    idle_pct = 100 * (cpu_seconds() - c0) / (time.monotonic() - w0)
    lat = []
    for i, gap in enumerate(GAPS * args.repeats):
        start = hvd.broadcast_object(time.time() + gap, 0, name=f"t{i}")
        late = 0.0 if rank == 0 else 0.02
        time.sleep(max(0.0, start + late - time.time()))
        if args.set and not pair.included():
            continue
        hvd.allreduce(torch.ones(4), name=f"first.{i}", process_set=pair if args.set else hvd.global_process_set)
        lat.append((time.time() - (start + 0.02)) * 1e3)
    out.put((rank, idle_pct, lat))
    hvd.barrier()  # a rank's shutdown stops every rank: the set's last ops first
    hvd.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--control", choices=["shm", "gloo"], default="shm")
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--verbose", action="store_true", help="every measurement, by idle gap")
    ap.add_argument("--set", action="store_true", help="a process set of ranks 0 and 1; the op runs in it")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    for rank, idle_pct, lat in res:
        if not lat:
            print(f"rank {rank} ({args.control}, not in the set): idle CPU {idle_pct:5.2f}% of a core")
            continue
        print(f"rank {rank} ({args.control}{', in the set' if args.set else ''}): idle CPU {idle_pct:5.2f}% of a core over {args.idle:.0f} s; "
              f"op after idle completes {statistics.median(lat):6.2f} ms (median), {max(lat):6.2f} ms (max) "
              "after the last rank submits")
        if args.verbose:
            print("   by idle gap (s): " + ", ".join(f"{g}: {x:.2f} ms" for g, x in zip(GAPS * args.repeats, lat)))


if __name__ == "__main__":
    main()
