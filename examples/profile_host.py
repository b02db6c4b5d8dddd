"""Where the host's time goes in a step: the 1.2B model at micro-batch 1 (the host sets the
pace there). Per mode and rank: the median step, the host time of each phase of a step run back
to back (forward, backward, step, zero_grad: the time the call took to return), then, with
HVDZ_CPROFILE=1, cProfile of rank 0 over 10 steps (the main thread only: backward's hooks run on
autograd's thread, which a sampling profiler sees, e.g. py-spy record --native --threads).
HVDZ_TIME_CALLS=1 times the ZeRO package's functions instead (host_calls.py): inclusive host
time and calls per step, over 10 steps, on every rank, for each mode but the floor.
HVDZ_SCHEDSTAT=1 says, per phase of 20 more steps, what the busiest threads did (on a CPU,
waiting for one, blocked: thread_sched.py), the median step and the slowest; and how long a
fixed piece of pure Python takes on autograd's thread at the start of each backward (the
host's speed there, whatever the step does).

    torchrun --nproc_per_node=2 examples/profile_host.py floor zero2 zero3
"""
import cProfile
import gc
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from host_calls import instrument_zero
from llama_model import LLAMA_1B, Decoder
from thread_sched import Snapshots

PHASES = ("forward", "backward", "step", "zero_grad")


def build(mode, cfg, dev):
    torch.manual_seed(0)
    with torch.device(dev):
        m = Decoder(**cfg).to(torch.bfloat16)
    if mode == "floor":
        return m, None
    stage, flags = int(mode[4]), set(mode.split("+")[1:])
    m.float()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, fused=True),
                                       model=m, stage=stage, param_dtype=torch.bfloat16,
                                       overlap_step="ostep" in flags, reshard_root_after_forward=stage == 3)
    return m, opt


def allocator_calls(before, after, steps):
    """What torch's caching allocator did per step that can stall the host: cudaMalloc and
    cudaFree calls (a free synchronizes the device), retries after a failed allocation
    (which free the cache first) and waits for every stream."""
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    return "allocator per step: " + ", ".join(
        f"{k[4:]} {(after.get(k, 0) - before.get(k, 0)) / steps:g}" for k in keys)


class SpeedProbe(torch.autograd.Function):
    """Passes its input through; its backward, at the start of the model's backward (after
    the loss's), times a fixed piece of pure Python on autograd's thread."""

    @staticmethod
    def forward(ctx, x, times):
        ctx.times = times
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        t = time.perf_counter()
        sum(i * i for i in range(20000))
        ctx.times.append(time.perf_counter() - t)
        return g, None


def make_step(m, opt, x, marks, sched=None, snapshots=None, probe=None):
    """One training step; appends the host time of each phase to marks, and with `sched`
    (a list) the threads' scheduler statistics at each phase's start and end; with `probe`
    (a list), SpeedProbe's time in each backward."""
    def mark(t):
        if sched is not None:
            sched[-1].append(snapshots.take())
        t.append(time.perf_counter())

    def step():
        if sched is not None:
            sched.append([])
        t = []
        mark(t)
        logits = m(x) if probe is None else SpeedProbe.apply(m(x), probe)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        mark(t)
        loss.backward()
        mark(t)
        if opt is not None:
            opt.step()
            mark(t)
            opt.zero_grad()
        else:
            mark(t)
            for p in m.parameters():
                p.grad = None
        mark(t)
        marks.append([b - a for a, b in zip(t, t[1:])])
    return step


def sched_report(mode, snapshots, steps, probe):
    """Per phase: the median step's and the slowest step's wall time, and for the threads
    busiest in it, on a CPU / waiting for one / blocked, in ms."""
    lines = []
    for k, phase in enumerate(PHASES[:3]):
        rows = [snapshots.between(s[k], s[k + 1]) for s in steps]
        rows.sort(key=lambda r: r[0])
        busiest = sorted(rows[len(rows) // 2][1].items(), key=lambda kv: -kv[1][0])[:4]
        for label, (wall, threads) in (("median", rows[len(rows) // 2]), ("slowest", rows[-1])):
            parts = ", ".join("{} {:.1f}/{:.1f}/{:.1f}".format(n, *threads.get(n, (0, 0, 0))) for n, _ in busiest)
            lines.append(f"   {phase:8s} {label:7s} {wall:6.1f} ms: {parts}")
    cost = sorted(snapshots.cost_ns)[len(snapshots.cost_ns) // 2] / 1e6
    lines.append(f"   (a snapshot of the threads took {cost:.2f} ms of the main thread's phase, median)")
    probe = sorted(probe)
    lines.append(f"   the same Python on autograd's thread: median {probe[len(probe) // 2] * 1e3:.2f} ms, "
                 f"fastest {probe[0] * 1e3:.2f}, slowest {probe[-1] * 1e3:.2f}")
    print(f"== {mode}, rank {hvd.rank()}: threads per phase (on a CPU/waiting for one/blocked, ms)\n"
          + "\n".join(lines), flush=True)


def main():
    hvd.init()
    dev = hvd.device()
    torch.cuda.set_device(dev)
    cfg = dict(LLAMA_1B)
    timer = instrument_zero() if os.environ.get("HVDZ_TIME_CALLS") == "1" else None
    for mode in sys.argv[1:]:
        m, opt = build(mode, cfg, dev)
        x = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), device=dev)
        marks = []
        step = make_step(m, opt, x, marks)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        marks.clear()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_stats(dev)
        t = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        back_to_back = (time.perf_counter() - t) / 20
        after = torch.cuda.memory_stats(dev)
        # Every rank: at a barrier (the step's count allreduce) one rank waits for the slower.
        phases = ", ".join(f"{p} {sorted(v)[10] * 1e3:.1f}" for p, v in zip(PHASES, zip(*marks)))
        print(f"== {mode}, rank {hvd.rank()}: median {sorted(times)[7] * 1e3:.1f} ms, back to back "
              f"{back_to_back * 1e3:.1f} ms, peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB; "
              f"host per phase (median, ms): {phases}; {allocator_calls(before, after, 20)}", flush=True)
        if os.environ.get("HVDZ_SCHEDSTAT") == "1":
            snapshots, snaps, probe = Snapshots(), [], []
            sched_step = make_step(m, opt, x, [], snaps, snapshots, probe)
            for _ in range(20):
                sched_step()
            torch.cuda.synchronize()
            sched_report(mode, snapshots, snaps, probe)
            del sched_step  # it holds the model and the optimizer: the next mode's peak is its own
        # For a sampling profiler outside (py-spy record --native --threads): steady steps only.
        spin = int(os.environ.get("HVDZ_SPIN_STEPS", "0"))
        if spin:
            print(f"== {mode}, rank {hvd.rank()}: spinning {spin} steps, pid {os.getpid()}", flush=True)
        for _ in range(spin):
            step()
        torch.cuda.synchronize()
        if timer is not None and opt is not None:
            timer.reset()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            print(f"== {mode}, rank {hvd.rank()}: host time per step by function (inclusive)\n{timer.table(10)}",
                  flush=True)
        elif os.environ.get("HVDZ_CPROFILE", "1") == "1":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            pr.disable()
            if hvd.rank() == 0:
                pstats.Stats(pr).sort_stats("tottime").print_stats(22)
        del opt, m, step
        gc.collect()  # the optimizer's hooks hold cycles: free this mode's memory before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
