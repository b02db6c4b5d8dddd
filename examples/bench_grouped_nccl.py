"""Plain torch.distributed calls (horovod_zero is not used): how fast NCCL runs many per-tensor calls
in one group against one flat call of the same bytes. This is what decides when a
fused op should skip the fusion buffer ([Note: direct groups] in
csrc/ops/plan_direct.cc).

    torchrun --nproc_per_node=N examples/bench_grouped_nccl.py

Tensors follow bench_collectives.py (Llama-3.2-1B layers, bf16). "hybrid" is one call
per tensor of 4 MiB and up plus one flat call for all the smaller ones, in one group.
"""

import time

import torch
import torch.distributed as dist

from llama_shapes import tensor_sizes


def per_call_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def grouped(dev, calls):
    def run():
        with dist._coalescing_manager(device=dev):
            for call in calls:
                call()
    return run


def main():
    dist.init_process_group("nccl")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    dev = torch.device("cuda", r)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    for total in (1 << 30, 64 << 20):
        sz = tensor_sizes(total, 2, n)
        shards = [torch.randn(s // n, device=dev).bfloat16() for s in sz]
        fulls = [torch.empty(s, **bf16) for s in sz]
        flat_in, flat_out = torch.empty(sum(sz) // n, **bf16), torch.empty(sum(sz), **bf16)
        big = [i for i, s in enumerate(sz) if s * 2 >= 4 << 20]
        small = [i for i in range(len(sz)) if i not in big]
        small_in = torch.empty(sum(sz[i] for i in small) // n, **bf16)
        small_out = torch.empty(sum(sz[i] for i in small), **bf16)
        ag = lambda i: (lambda: dist.all_gather_into_tensor(fulls[i], shards[i]))
        rs = lambda i: (lambda: dist.reduce_scatter_tensor(shards[i], fulls[i]))
        res = {
            "allgather flat": per_call_ms(lambda: dist.all_gather_into_tensor(flat_out, flat_in)),
            f"allgather grouped, {len(sz)} calls": per_call_ms(grouped(dev, [ag(i) for i in range(len(sz))])),
            f"allgather hybrid, {len(big)} calls + 1": per_call_ms(grouped(
                dev, [ag(i) for i in big] + [lambda: dist.all_gather_into_tensor(small_out, small_in)])),
            "reducescatter flat": per_call_ms(lambda: dist.reduce_scatter_tensor(flat_in, flat_out)),
            f"reducescatter grouped, {len(sz)} calls": per_call_ms(grouped(dev, [rs(i) for i in range(len(sz))])),
        }
        if r == 0:
            print(f"== {total >> 20} MiB in {len(sz)} tensors, {n} GPUs, NCCL {torch.cuda.nccl.version()}")
            for k, v in res.items():
                flat = res["allgather flat" if k.startswith("allgather") else "reducescatter flat"]
                print(f"{k:34s} {v:7.3f} ms   speed vs flat {flat / v:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
