"""Latency of one small collective, to see what negotiation costs: a raw Gloo
allgather of one negotiation header, horovod_zero allreduce on CPU and on CUDA,
and torch.distributed (NCCL) allreduce, each synchronous, median of many.

    torchrun --nproc_per_node=8 examples/bench_latency.py
"""

import statistics
import time

import torch
import torch.distributed as dist

import horovod_zero.torch as hvd


def lat(fn, n=300, warm=30):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main():
    hvd.init()
    cuda = torch.cuda.is_available() and hvd.cuda_built()
    dist.init_process_group("nccl" if cuda else "gloo", device_id=hvd.device() if cuda else None)
    rows = {}
    # A Gloo group of its own: the runtime's is busy with its background loop.
    gloo = dist.new_group(backend="gloo")
    hdr_in, hdr_out = torch.zeros(264, dtype=torch.uint8), torch.zeros(264 * hvd.size(), dtype=torch.uint8)
    rows["raw gloo allgather, 264 B (one negotiation)"] = lat(
        lambda: dist.all_gather_into_tensor(hdr_out, hdr_in, group=gloo))
    x = torch.ones(16)
    rows["horovod_zero allreduce, CPU"] = lat(lambda: hvd.allreduce(x, name="lat.cpu"))
    if cuda:
        y = torch.ones(16, device=hvd.device())
        rows["horovod_zero allreduce, CUDA"] = lat(lambda: (hvd.allreduce(y, name="lat.cuda"), torch.cuda.synchronize()))
        rows["torch.distributed allreduce, NCCL"] = lat(lambda: (dist.all_reduce(y), torch.cuda.synchronize()))
    if hvd.rank() == 0:
        info = hvd.runtime_info()
        print(f"== bench_latency: {hvd.size()} ranks, negotiation over {info['control_plane']}, "
              f"HOROVOD_CYCLE_TIME={info['cycle_time_ms']} ms")
        for k, v in rows.items():
            print(f"{k:45s} {v:9.1f} us")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
