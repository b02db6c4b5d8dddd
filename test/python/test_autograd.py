"""The synchronous collectives are differentiable: each rank's input gradient equals
what plain torch autograd gives for the sum of every rank's loss, computed in one
process on all ranks' inputs."""

import torch

import horovod_zero.torch as hvd
from refs import make, scatter_rows


def _inputs(n, shape, seed):
    return [make(k, shape, "float64", seed) for k in range(n)]


def _grads():
    n, r = hvd.size(), hvd.rank()
    out = {}
    # Each rank's loss weighs the collective's output with weights of its own.
    cases = {
        "allreduce_sum": (lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="ag.ar"),
                          lambda xs: 3.0 * sum(0.5 * x for x in xs), (4, 3)),
        "allreduce_avg": (lambda x: hvd.allreduce(x, name="ag.avg"), lambda xs: sum(xs) / n, (5,)),
        "allgather": (lambda x: hvd.allgather(x, name="ag.ag"), lambda xs: torch.cat(xs), None),
        "reducescatter": (lambda x: hvd.reducescatter(x, op=hvd.Average, name="ag.rs"),
                          lambda xs: sum(xs) / n, (7, 2)),
        "broadcast": (lambda x: hvd.broadcast(x, root_rank=n - 1, name="ag.bc"), lambda xs: xs[n - 1], (3, 2)),
    }
    for key, (collective, math, shape) in cases.items():
        if key == "allgather":
            xs = [make(k, (k + 1, 2), "float64", 31) for k in range(n)]  # uneven rows
        else:
            xs = _inputs(n, shape, 30)
        # Ours: this rank's input, this rank's loss.
        x = xs[r].clone().requires_grad_(True)
        y = collective(x)
        shapes = [(scatter_rows(7, n, k), 2) if key == "reducescatter" else tuple(y.shape) for k in range(n)]
        ws = [make(100 + k, shapes[k], "float64", 32) for k in range(n)]
        (y * ws[r]).sum().backward()
        # Reference: every rank's input and loss in one process.
        ref_xs = [t.clone().requires_grad_(True) for t in xs]
        y_all = math(ref_xs)
        if key == "reducescatter":  # rank k keeps its row block of the reduction
            starts = [sum(scatter_rows(7, n, j) for j in range(k)) for k in range(n)]
            losses = [(y_all[starts[k]:starts[k] + scatter_rows(7, n, k)] * ws[k]).sum() for k in range(n)]
        else:
            losses = [(y_all * ws[k]).sum() for k in range(n)]
        sum(losses).backward()
        ref = ref_xs[r].grad if ref_xs[r].grad is not None else torch.zeros_like(x)  # unused input: zero gradient
        out[key] = float((x.grad - ref).abs().max())
    return out


def test_collectives_have_exact_gradients(ranks):
    for errs in ranks.run(_grads):
        assert all(e < 1e-12 for e in errs.values()), errs
