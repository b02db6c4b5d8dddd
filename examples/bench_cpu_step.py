"""Step time on CPU ranks: DDP over Gloo against DistributedZeroOptimizer stages 1
and 2, side by side in the same processes, on a 16.8M-parameter MLP (16 x
Linear(1024, 1024), batch 64, fp32, torch.optim.AdamW(fused=True)).

    python examples/bench_cpu_step.py [--ranks 2] [--threads 1] [--steps 10] [--warmup 3]
                                      [--systems ddp,zero1,zero2] [--pin] [--repeats 1] [--thread-cpu]

--systems also takes zero2+overlap (overlap_param_gather=True).

Every rank builds the three systems from the same seed (DDP on a torch.distributed
Gloo group of its own store, ours on hvd.init()), then runs them in turns, one
step each, so that a change of load on a shared machine hits all of them. Each
step is split into phases timed on the training thread:
  fwd      forward
  bwd      backward (DDP: with its allreduces and their final wait; ZeRO stage 2:
           with the hooks that enqueue the reduce-scatters)
  reduce   ZeRO: submitting what is left and waiting for the reductions (step's start)
  inner    the inner optimizer's step (ZeRO: on the master shards)
  gather   ZeRO: the allgather of the updated shards into the parameters (with
           "zero2+overlap", overlap_param_gather=True: only its enqueue; the
           forward waits for each layer's parameters)
  rest     everything else: zero_grad, Python around the step
`cpu` is the CPU time of every thread of the process per step (the background
thread, Gloo's threads); with one core per rank, CPU time beyond the training
thread's competes with it. --pin puts rank r, every thread of it, on the r-th core
this job may use (as taskset would). Medians over the timed steps, then the median and
range over ranks and repeats. --thread-cpu adds each thread's CPU time per step (the
runtime's threads are named hvdz-*), summed over the systems run: name one system
to read its own.
"""

import argparse
import faulthandler
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import threading
import time

PHASES = ("fwd", "bwd", "reduce", "inner", "gather", "rest")


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return r.ru_utime + r.ru_stime


def thread_cpu():
    """CPU seconds of each thread of this process, keyed "name#tid" ("main" is the training thread):
    which thread's work competes with the training thread for its core."""
    tick, main = os.sysconf("SC_CLK_TCK"), threading.get_native_id()
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has exited
        name = "main" if int(tid) == main else stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}#{tid}"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def build_model(torch, width, layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


class Timer:
    """Accumulates the wall time of wrapped calls into one phase of the current step."""

    def __init__(self):
        self.now = {}

    def wrap(self, phase, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t0
        return timed


def make_system(name, torch, args, rank):
    m = build_model(torch, args.width, args.layers)
    timer = Timer()
    if name == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(m, process_group=args.ddp_group)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
        opt.step = timer.wrap("inner", opt.step)
    else:
        import horovod_zero.torch as hvd
        net = m
        inner = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        opt = hvd.DistributedZeroOptimizer(inner, model=m, stage=int(name[4]),
                                           overlap_param_gather=name.endswith("+overlap"))
        # Instance attributes shadow the methods step() calls.
        opt._finish_reduction = timer.wrap("reduce", opt._finish_reduction)
        inner.step = timer.wrap("inner", inner.step)
        opt._params.publish = timer.wrap("gather", opt._params.publish)  # stages 1-2: the allgather after the step
    return net, opt, timer


def one_step(torch, net, opt, timer, x):
    timer.now = {}
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = net(x)
    loss = out.square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    ph = dict(timer.now)
    ph["fwd"], ph["bwd"] = t1 - t0, t2 - t1
    ph["rest"] = (t3 - t2) - sum(ph.get(p, 0.0) for p in ("reduce", "inner", "gather"))
    ph["step"], ph["cpu"] = t3 - t0, cpu_seconds() - c0
    return ph


def rank_main(rank, args, port, out):
    faulthandler.enable()  # a crash in native code prints where it happened
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))  # the cores this job may use, not every core
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(args.threads))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    systems = args.systems.split(",")
    if "ddp" in systems:
        store = dist.TCPStore("127.0.0.1", port + 1, args.ranks, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
        args.ddp_group = dist.group.WORLD
    if any(s.startswith("zero") for s in systems):
        import horovod_zero.torch as hvd
        hvd.init()
    built = {s: make_system(s, torch, args, rank) for s in systems}
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width)
    results = {s: [] for s in systems}
    threads_before = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            threads_before = thread_cpu()
        # Turns rotate each step, so no system always runs right after the same one.
        for k in range(len(systems)):
            s = systems[(i + k) % len(systems)]
            net, opt, timer = built[s]
            ph = one_step(torch, net, opt, timer, x)
            if i >= args.warmup:
                results[s].append(ph)
    med = {s: {p: statistics.median(r.get(p, 0.0) for r in rs) * 1e3 for p in PHASES + ("step", "cpu")}
           for s, rs in results.items()}
    if args.thread_cpu:
        # Per thread, ms per timed step of all systems together: run one system to read its own.
        after = thread_cpu()
        med["threads"] = {n: (t - threads_before.get(n, 0.0)) * 1e3 / args.steps for n, t in after.items()}
    out.put((rank, med))
    if "ddp" in systems:
        dist.destroy_process_group()
    if any(s.startswith("zero") for s in systems):
        hvd.shutdown()


def free_port():
    # Two consecutive ports: hvd's store, then DDP's.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def run_once(args):
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res, deadline = [], time.monotonic() + 900
    while len(res) < len(procs):
        try:
            res.append(out.get(timeout=5))
        except queue.Empty:
            # A rank that died (a signal, a C++ abort) never reports: name it instead of waiting.
            done = {r for r, _ in res}
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = ", ".join(f"rank {r} exit code {c}" for r, c in dead) or "900 s passed"
                raise SystemExit(f"bench_cpu_step: ranks did not all report ({why}); see their output above")
    for p in procs:
        p.join(timeout=60)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS too)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per repeat")
    ap.add_argument("--systems", default="ddp,zero1,zero2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--pin", action="store_true", help="rank r runs on core r only")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="also print each thread's CPU ms per step (all systems together)")
    args = ap.parse_args()
    args.ddp_group = None
    systems = args.systems.split(",")
    per = {s: [] for s in systems}  # one entry per rank and repeat: the medians of its steps
    for rep in range(args.repeats):
        for rank, med in sorted(run_once(args), key=lambda t: t[0]):
            for s in systems:
                per[s].append(med[s])
            if "threads" in med:
                busy = sorted(med["threads"].items(), key=lambda kv: -kv[1])
                print(f"repeat {rep} rank {rank}: CPU ms per step by thread: "
                      + ", ".join(f"{n} {t:.1f}" for n, t in busy), flush=True)
        line = "  ".join(f"{s} {statistics.median(m['step'] for m in per[s][-args.ranks:]):.1f}" for s in systems)
        print(f"repeat {rep}: step ms (median of ranks) {line}", flush=True)
    print(f"\n{args.ranks} ranks x {args.threads} thread(s), {args.layers} x Linear({args.width}), batch {args.batch}, "
          f"fp32, AdamW(fused=True); {args.steps} steps after {args.warmup} warmup, {args.repeats} repeat(s)"
          f"{', pinned' if args.pin else ''}. ms: median over ranks and repeats of each's median step [min-max].")
    print(f"{'system':14} {'step':>20} {'vs ddp':>7} " + " ".join(f"{p:>7}" for p in PHASES) + f" {'cpu':>7}")
    base = statistics.median(m["step"] for m in per["ddp"]) if "ddp" in per else None
    for s in systems:
        steps = [m["step"] for m in per[s]]
        med = statistics.median(steps)
        ratio = f"{med / base:6.2f}x" if base else "     -"
        cols = " ".join(f"{statistics.median(m[p] for m in per[s]):7.1f}" for p in PHASES)
        cpu = statistics.median(m["cpu"] for m in per[s])
        print(f"{s:14} {med:7.1f} [{min(steps):5.1f}-{max(steps):5.1f}] {ratio:>7} {cols} {cpu:7.1f}")


if __name__ == "__main__":
    main()
