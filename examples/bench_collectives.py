"""Collective benchmark: horovod_zero's fused allgather / reducescatter against
torch.distributed's all_gather_into_tensor / reduce_scatter_tensor (NCCL) on the
same bytes, and 1,000 small async allreduces against 1,000 torch.distributed calls.

    HOROVOD_FUSION_THRESHOLD=2147483648 torchrun --nproc_per_node=8 examples/bench_collectives.py
    HOROVOD_AUTOTUNE=1 HOROVOD_AUTOTUNE_LOG=autotune.csv torchrun --nproc_per_node=8 examples/bench_collectives.py

With HOROVOD_AUTOTUNE=1 the first total's work (and the small allreduces) first runs
until the autotuner has kept its best setting (at most --tune-max-steps steps); the
measurements then run with that setting.

Tensors follow a Llama-3.2-1B decoder layer (d=2048, 8 KV heads of 64, FFN 8192),
sharded as ZeRO shards them: each rank contributes numel/size of every tensor.
Bus bandwidth = bytes * (size - 1) / size / time, as nccl-tests reports it.

Two ways of timing each op: "one op" waits for every op before starting the next
(negotiation and copies add to it in full); "stream" keeps --depth ops in flight,
as a training loop does, and reports time per op over --rounds ops, against the same
number of torch calls issued back to back (as nccl-tests times its iterations).
"""

import argparse
import collections
import os
import time

import torch
import torch.distributed as dist

import horovod_zero.torch as hvd
from bench_timing import median_time, run_until_tuned, sync, tuned_text
from llama_shapes import tensor_sizes


def timed(fn, iters):
    return median_time(fn, iters, before_each=dist.barrier)


def streamed(enqueue, rounds, depth):
    """Seconds per op with `depth` ops in flight; enqueue(k) uses name set k < depth,
    so that no name is in flight twice and the response cache stays warm."""
    def run():
        pending = collections.deque()
        for i in range(rounds):
            if len(pending) == depth:
                hvd.synchronize(pending.popleft())
            pending.append(enqueue(i % depth))
        for h in pending:
            hvd.synchronize(h)
    return median_time(run, 3, warmup=1, before_each=dist.barrier) / rounds


def torch_streamed(call, rounds):
    def run():
        for _ in range(rounds):
            call()
    return median_time(run, 3, warmup=1, before_each=dist.barrier) / rounds


def profile_table(fn, label, trace_dir=None):
    """Device time per kernel for 3 calls of fn, so the copies and the collective
    can be told apart (rank 0 prints, and writes a Chrome trace into trace_dir)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        sync()
    if hvd.rank() == 0:
        print(f"-- profile: {label} (3 calls)")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=8, max_name_column_width=60), flush=True)
        if trace_dir:
            prof.export_chrome_trace(os.path.join(trace_dir, label.replace(" ", "_") + ".json"))


def bandwidth_tensors(total, dtype):
    """A decoder layer's tensors (sizes), each rank's shards of them and full ones."""
    n, dev = hvd.size(), hvd.device()
    sizes = tensor_sizes(total, torch.tensor([], dtype=dtype).element_size(), n)
    return sizes, [torch.randn(s // n, device=dev).to(dtype) for s in sizes], \
        [torch.randn(s, device=dev).to(dtype) for s in sizes]


def tune(total, dtype, small, max_steps):
    """HOROVOD_AUTOTUNE=1: steps of the benchmark's work (the allgather and reducescatter
    of `total`, `small` small allreduces) until the autotuner keeps its best setting, which
    the measurements then run with."""
    if hvd.runtime_info()["autotune"] is None:
        return 0, None
    _, shards, fulls = bandwidth_tensors(total, dtype)
    ts = [torch.randn(256, device=hvd.device()) for _ in range(small)]

    def step():
        hvd.synchronize([hvd.grouped_allgather_async(shards, name="bw.ag"),
                         hvd.grouped_reducescatter_async(fulls, op=hvd.Sum, name="bw.rs")] +
                        [hvd.allreduce_async(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(ts)])
    return run_until_tuned(step, max_steps)


def bench_bandwidth(total, dtype, iters, rounds, depth, profile, trace_dir):
    n, dev = hvd.size(), hvd.device()
    esz = torch.tensor([], dtype=dtype).element_size()
    sizes, shards, fulls = bandwidth_tensors(total, dtype)
    nbytes = sum(sizes) * esz
    flat_in = torch.empty(nbytes // esz // n, dtype=dtype, device=dev)
    flat_out = torch.empty(nbytes // esz, dtype=dtype, device=dev)
    rows = []
    t_hvd = timed(lambda: hvd.grouped_allgather(shards, name="bw.ag"), iters)
    t_torch = timed(lambda: dist.all_gather_into_tensor(flat_out, flat_in), iters)
    rows.append(("allgather", len(sizes), nbytes, t_hvd, t_torch))
    t_hvd = timed(lambda: hvd.grouped_reducescatter(fulls, op=hvd.Sum, name="bw.rs"), iters)
    t_torch = timed(lambda: dist.reduce_scatter_tensor(flat_in, flat_out), iters)
    rows.append(("reducescatter", len(sizes), nbytes, t_hvd, t_torch))
    # Pipelined: the same allgather split into 4 groups in flight at once, as ZeRO issues
    # them, so the negotiation of one overlaps the communication of another.
    quarters = [shards[i::4] for i in range(4)]
    q_in = [torch.empty(nbytes // esz // 4 // n, dtype=dtype, device=dev) for _ in range(4)]
    q_out = [torch.empty(nbytes // esz // 4, dtype=dtype, device=dev) for _ in range(4)]
    t_hvd = timed(lambda: hvd.synchronize(
        [hvd.grouped_allgather_async(q, name=f"bw.ag4.{i}") for i, q in enumerate(quarters) if q]), iters)
    t_torch = timed(lambda: [w.wait() for w in [dist.all_gather_into_tensor(q_out[i], q_in[i], async_op=True)
                                                for i in range(4)]], iters)
    rows.append(("allgather x4", len(sizes), nbytes, t_hvd, t_torch))
    t_hvd = streamed(lambda k: hvd.grouped_allgather_async(shards, name=f"bw.sag{k}"), rounds, depth)
    t_torch = torch_streamed(lambda: dist.all_gather_into_tensor(flat_out, flat_in), rounds)
    rows.append(("allgather strm", len(sizes), nbytes, t_hvd, t_torch))
    t_hvd = streamed(lambda k: hvd.grouped_reducescatter_async(fulls, op=hvd.Sum, name=f"bw.srs{k}"), rounds, depth)
    t_torch = torch_streamed(lambda: dist.reduce_scatter_tensor(flat_in, flat_out), rounds)
    rows.append(("redscat strm", len(sizes), nbytes, t_hvd, t_torch))
    if profile:
        mib = nbytes >> 20
        profile_table(lambda: hvd.grouped_allgather(shards, name="bw.ag"), f"allgather {mib} MiB", trace_dir)
        profile_table(lambda: hvd.grouped_reducescatter(fulls, op=hvd.Sum, name="bw.rs"), f"reducescatter {mib} MiB",
                      trace_dir)
    return rows


def bench_small(count):
    dev = hvd.device()
    ts = [torch.randn(256, device=dev) for _ in range(count)]
    for rep in range(3):  # warm the response cache and NCCL
        hvd.synchronize([hvd.allreduce_async(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(ts)])
    dist.barrier()
    sync()
    hvd.collective_stats(reset=True)
    t0 = time.perf_counter()
    hs = [hvd.allreduce_async(t, op=hvd.Sum, name=f"small.{i}") for i, t in enumerate(ts)]
    t_enq = time.perf_counter() - t0
    hvd.synchronize(hs)
    sync()
    t_hvd = time.perf_counter() - t0
    collectives = sum(s["collectives"] for s in hvd.collective_stats())
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    sync()
    t_torch = time.perf_counter() - t0
    return t_hvd, t_enq / count, t_torch, collectives


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--totals", default="64MiB,1GiB")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20, help="ops per streamed measurement")
    ap.add_argument("--depth", type=int, default=2, help="ops in flight in the streamed measurement")
    ap.add_argument("--small", type=int, default=1000, help="number of small async allreduces")
    ap.add_argument("--profile", action="store_true", help="print per-kernel device time of each fused op")
    ap.add_argument("--trace-dir", default=None, help="with --profile: write Chrome traces here")
    ap.add_argument("--tune-max-steps", type=int, default=5000,
                    help="with HOROVOD_AUTOTUNE=1: most steps of the first total's work the tuning may take before "
                         "the measurements")
    args = ap.parse_args()
    hvd.init()
    cuda = hvd.device().type == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.device())
    dist.init_process_group("nccl" if cuda else "gloo", device_id=hvd.device() if cuda else None)
    n = hvd.size()
    units = {"MiB": 1 << 20, "GiB": 1 << 30}
    out = []
    first = args.totals.split(",")[0]
    tuned = tuned_text(*tune(int(first[:-3]) * units[first[-3:]], torch.bfloat16, args.small, args.tune_max_steps))
    if tuned:
        out.append(tuned + f" (on {first} and {args.small} small allreduces per step)")
    for spec in args.totals.split(","):
        total = int(spec[:-3]) * units[spec[-3:]]
        for op, ntensors, nbytes, th, tt in bench_bandwidth(total, torch.bfloat16, args.iters, args.rounds, args.depth, args.profile, args.trace_dir):
            bus = lambda t: nbytes * (n - 1) / n / t / 1e9
            out.append(f"{op:15s} {spec:>6s} bf16 {ntensors:4d} tensors  horovod_zero {th*1e3:8.2f} ms "
                       f"{bus(th):7.1f} GB/s | torch {tt*1e3:8.2f} ms {bus(tt):7.1f} GB/s | ratio {tt/th:5.2f}")
    t_hvd, per_enq, t_torch, colls = bench_small(args.small)
    # Fusion factor: tensors per collective. Enqueueing alone bounds the speedup at
    # t_torch / (count * host time per enqueue), however few collectives run.
    out.append(f"{args.small} small async allreduces: horovod_zero {t_hvd*1e3:.2f} ms (host {per_enq*1e6:.2f} us per enqueue, "
               f"{colls} collectives: fusion factor {args.small / max(colls, 1):.0f}) | torch {t_torch*1e3:.2f} ms | "
               f"speedup {t_torch/t_hvd:.1f}x (enqueue-bound limit {t_torch / (args.small * per_enq):.1f}x)")
    stats = hvd.collective_stats()
    if hvd.rank() == 0:
        print(f"== bench_collectives: {n} ranks, {torch.cuda.get_device_name() if cuda else 'cpu'}, "
              f"HOROVOD_FUSION_THRESHOLD={os.environ.get('HOROVOD_FUSION_THRESHOLD', 'default')}, "
              f"HOROVOD_ZERO_DIRECT_MAX_TENSORS={os.environ.get('HOROVOD_ZERO_DIRECT_MAX_TENSORS', 'default')}, "
              f"depth {args.depth}")
        for line in out:
            print(line, flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
