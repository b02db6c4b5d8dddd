"""Where the host's time goes in a step: the 1.2B model at micro-batch 1 (the host sets the
pace there), median step time, then cProfile of rank 0 over 10 steps.

    torchrun --nproc_per_node=2 examples/profile_host.py floor zero2 zero3
"""
import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from llama_model import LLAMA_1B, Decoder

hvd.init()
dev = hvd.device()
torch.cuda.set_device(dev)
cfg = dict(LLAMA_1B)
for mode in sys.argv[1:]:
    torch.manual_seed(0)
    with torch.device(dev):
        m = Decoder(**cfg).to(torch.bfloat16)
    x = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), device=dev)
    opt = None
    if mode != "floor":
        stage, flags = int(mode[4]), set(mode.split("+")[1:])
        m.float()
        opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1), model=m,
                                           stage=stage, param_dtype=torch.bfloat16, overlap_step="ostep" in flags,
                                           reshard_root_after_forward=stage == 3)

    def step():
        F.cross_entropy(m(x).flatten(0, 1).float(), x.flatten()).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            for p in m.parameters():
                p.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if hvd.rank() == 0:
        print(f"== {mode}: median {sorted(times)[7] * 1e3:.1f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    pr.disable()
    if hvd.rank() == 0:
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(22)
    del opt, m
    torch.cuda.empty_cache()
