"""Ranks whose backward passes differ (a branch only some ranks' forward takes), with
several backward passes per step and with gradients dropped by zero_grad() before
step(): every rank must still make the same reductions ([Note: one count of reductions
on every rank] in core/reduce.py). Each case is checked against plain torch on one
process. 2 and 3 CPU ranks (a stall fails the case at the pool's time limit)."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import scoped_env


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use_b):
        y = self.a(x)
        return self.b(y) if use_b else y


def _x(rank, k):
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * rank + k))


def _uses_b(rank, k):
    """Rank 0 takes the branch in every pass, rank 1 in none, rank 2 in the second only."""
    return rank == 0 or (rank == 2 and k == 1)


def _passes(model, rank, passes):
    for k in range(passes):
        model(_x(rank, k), _uses_b(rank, k)).square().sum().backward()


def _reference(size, passes, dropped_first):
    """SGD(lr=0.1) after the average over ranks of each rank's gradient summed over its passes
    (after dropped_first, only the passes after the dropped one, with b used everywhere)."""
    model = Branchy()
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(size):
        m = Branchy()
        if dropped_first:
            m(_x(r, 9), True).square().sum().backward()
        else:
            _passes(m, r, passes)
        for g, p in zip(grads, m.parameters()):
            if p.grad is not None:
                g += p.grad / size
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= 0.1 * g
    return [p.detach() for p in model.parameters()]


def _train(stage, passes, dropped_first, mode):
    r = hvd.rank()
    model = Branchy()
    # Stage 3: every rank must gather the same units, so the branch is in the root.
    units = {"units": [model.a]} if stage == 3 else {}
    # A tiny bucket sends each gradient as soon as it is ready, as a large model's would.
    with scoped_env(HOROVOD_ZERO_BUCKET_BYTES=1):
        opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=stage,
                                           backward_passes_per_step=3 if mode == "bpps" else 1, **units)
    if dropped_first:  # the first backward differs, and is dropped before step()
        _passes(model, r, 1)
        opt.zero_grad()
        model(_x(r, 9), True).square().sum().backward()
    elif mode == "coalesce":
        for k in range(passes):  # one coalescing block per pass: each ends with its own reductions
            with opt.coalesce_grad_reduction():
                model(_x(r, k), _uses_b(r, k)).square().sum().backward()
    else:
        _passes(model, r, passes)
    opt.step()
    if stage == 3:
        with opt.gathered_params():
            out = [p.detach().tolist() for p in model.parameters()]
    else:
        out = [p.detach().tolist() for p in model.parameters()]
    hvd.barrier()
    return out


@pytest.mark.parametrize("stage,passes,dropped_first,mode", [
    (2, 2, False, "each"),        # a reduction per pass: rank 0 makes two of b, rank 1 none
    (3, 2, False, "each"),
    (2, 4, False, "bpps"),        # backward_passes_per_step=3 and 4 passes: rank 0 reduces b twice, rank 1 once
    (2, 2, False, "coalesce"),    # two coalescing blocks in one step
    (2, 1, True, "each"),         # zero_grad() before step() after a backward that differs
    (3, 1, True, "each"),
], ids=["stage2-per-pass", "stage3-per-pass", "stage2-bpps", "stage2-coalesce-blocks", "stage2-dropped",
        "stage3-dropped"])
def test_ranks_whose_backward_differs_make_the_same_reductions(ranks, stage, passes, dropped_first, mode):
    ref = _reference(ranks.size, passes, dropped_first)
    for rank, value in enumerate(ranks.run(_train, stage, passes, dropped_first, mode)):
        for p, q in zip(value, ref):
            p = torch.tensor(p)
            assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), (rank, (p - q).abs().max())
