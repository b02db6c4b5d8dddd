"""Trains a small MLP with data parallelism over horovod_zero collectives.

Each rank takes its own slice of every batch; gradients are averaged with one
grouped allreduce per step (negotiated together, fused into one collective).
Runs on CPU (Gloo) or, when CUDA is usable, on this rank's GPU (NCCL).

    torchrun --nproc_per_node=2 examples/train_mlp.py
    python -m horovod_zero.runner -np 2 -H localhost:2 python examples/train_mlp.py
"""

import argparse
import time

import torch

import horovod_zero.torch as hvd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()

    hvd.init()
    dev = hvd.device()
    torch.manual_seed(1234 + hvd.rank())  # every rank starts from different weights...
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
        torch.nn.Linear(args.width, 1),
    ).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ...until rank 0's are broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # A fixed target function; each rank draws a different slice of each global batch.
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(32, 1, generator=g)
    local = args.batch // hvd.size()
    params = [p for p in model.parameters()]
    t0 = time.time()
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(10_000 + step)
        x = torch.randn(args.batch, 32, generator=gen)[hvd.rank() * local:(hvd.rank() + 1) * local].to(dev)
        y = torch.sin(x @ w_true.to(dev))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = hvd.grouped_allreduce([p.grad for p in params], op=hvd.Average, name="grads")
        for p, g_avg in zip(params, grads):
            p.grad.copy_(g_avg)
        opt.step()
        global_loss = hvd.allreduce(loss.detach(), op=hvd.Average, name="loss").item()
        if hvd.rank() == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {global_loss:.5f}", flush=True)

    # Data parallelism keeps every rank's weights identical: check it.
    flat = torch.cat([p.detach().flatten() for p in params])
    spread = hvd.allreduce(flat, op=hvd.Max, name="check.max") - hvd.allreduce(flat, op=hvd.Min, name="check.min")
    if hvd.rank() == 0:
        stats = hvd.collective_stats()
        calls = sum(s["collectives"] for s in stats)
        print(f"done: {args.steps} steps in {time.time() - t0:.1f} s on {hvd.size()} ranks ({dev}); "
              f"max weight difference between ranks {spread.abs().max().item():.2e}; {calls} collectives")
    hvd.shutdown()


if __name__ == "__main__":
    main()
