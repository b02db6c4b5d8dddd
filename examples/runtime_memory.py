"""Device memory the runtime holds outside torch's allocator, under the HOROVOD_* settings
of the environment: NCCL's communicators (one per device context, a second with
HOROVOD_ZERO_GATHER_STREAM=1), their buffers and the copy-engine window. torch's peak
memory (what bench_zero.py reports) does not count it. Per rank: the GPU's used memory
after one allgather and one reduce-scatter, less what it was before init(), less torch's
reserved memory.

    torchrun --nproc_per_node=2 examples/runtime_memory.py
    HOROVOD_ZERO_GATHER_STREAM=1 torchrun --nproc_per_node=2 examples/runtime_memory.py
"""
import os

import torch

import horovod_zero.torch as hvd


def used(dev):
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def main():
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)  # the CUDA context, which is not the runtime's
    before = used(dev) - torch.cuda.memory_reserved(dev)
    hvd.init()
    x = torch.ones(1 << 20, device=dev, dtype=torch.bfloat16)
    hvd.allgather(x, name="memory.gather")
    hvd.reducescatter(torch.ones(hvd.size() << 20, device=dev, dtype=torch.bfloat16), name="memory.reduce")
    torch.cuda.synchronize(dev)
    after = used(dev) - torch.cuda.memory_reserved(dev)
    info = hvd.runtime_info()
    print(f"rank {hvd.rank()}: {(after - before) / 2**20:.0f} MiB outside torch's allocator "
          f"(gather lanes {info['gather_lanes']}, window {info['gather_window_bytes'] / 2**20:.0f} MiB)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
