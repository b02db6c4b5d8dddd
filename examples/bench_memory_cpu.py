"""Resident memory of CPU training: DDP over Gloo against DistributedZeroOptimizer,
each in fresh processes, on a 16.8M-parameter MLP (16 x Linear(1024, 1024)) with AdamW.

    python examples/bench_memory_cpu.py [--ranks 2] [--steps 6] [--modes ddp,zero1,zero2]

Per mode and rank: RSS after init, after building the model and optimizer, the
largest after a backward or a step, the process's peak (ru_maxrss), and the median
step time, wall and CPU (every thread: less disturbed by a busy machine); the
model's parameters, gradients and AdamW state are 16.8M x 4 B = 67 MB each.
"""

import argparse
import multiprocessing as mp
import os
import resource
import socket
import statistics
import time


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return r.ru_utime + r.ru_stime


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])


def rank_main(rank, size, port, mode, steps, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    if mode == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=size)
    else:
        import horovod_zero.torch as hvd
        hvd.init()
    base = rss_mb()
    m = model(torch)
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    else:
        net = m
        opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), model=m,
                                           stage=int(mode[-1]))
    built = rss_mb()
    x = torch.randn(32, 1024)
    phases, times, cpu = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), cpu_seconds()
        net(x).square().mean().backward()
        phases.append(rss_mb())
        opt.step()
        phases.append(rss_mb())
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
    after = max(phases)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    out.put((rank, base, built, after, peak, statistics.median(times[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3))
    if mode == "ddp":
        torch.distributed.destroy_process_group()
    else:
        hvd.shutdown()


def run(mode, ranks, steps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, ranks, port, mode, steps, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    res = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default="ddp,zero1,zero2")
    args = ap.parse_args()
    print("RSS in MB: after init (torch.distributed or hvd), after building model and optimizer, the largest")
    print("after a backward or step, the process's peak; and the largest minus the first.")
    print("mode   rank    init   built  largest  peak   largest-init  step ms  CPU ms per step (medians)")
    for mode in args.modes.split(","):
        for rank, base, built, after, peak, step_ms, cpu_ms in run(mode, args.ranks, args.steps):
            print(f"{mode:6} {rank:4} {base:7.0f} {built:7.0f} {after:8.0f} {peak:6.0f}   {after - base:8.0f}"
                  f"   {step_ms:7.1f}  {cpu_ms:7.1f}")


if __name__ == "__main__":
    main()
