"""Gradients of the differentiable collectives, single and grouped, under both
conventions of autograd.py ([Note: gradient conventions]):
- by default Horovod's, checked against Horovod's backward formulas written out here;
- with HOROVOD_ZERO_EXACT_GRADIENTS=1 the exact gradient of the sum of every rank's
  loss, checked against plain torch autograd run in one process on every rank's inputs.
Rank k's loss is sum_i (output_i * W[k][i]) with weights of its own, so every rank's
gradient differs."""

import os

import pytest
import torch

import horovod_zero.torch as hvd
from harness import shared_pool
from refs import make, scatter_slice

EXACT_ENV = "HOROVOD_ZERO_EXACT_GRADIENTS"


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def exact_ranks(request):
    return shared_pool(request.param, env={EXACT_ENV: "1"})


def _cases(n, r):
    """name -> (input shapes of rank k, our collective on this rank's inputs, the
    outputs rank k sees as plain torch maths over every rank's inputs X, Horovod's
    input gradients of rank r given every rank's output weights W)."""
    rows = [k + 1 for k in range(n)]  # uneven allgather
    mine = slice(sum(rows[:r]), sum(rows[:r]) + rows[r])

    def total(W, i):
        return sum(w[i] for w in W)

    def cat(W, i):  # every rank's reducescatter block back in one tensor
        return torch.cat([w[i] for w in W])

    return {
        "allreduce_sum_scaled": (
            lambda k: [(4, 3)],
            lambda x: [hvd.allreduce(x[0], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="ag.ar")],
            lambda X, k: [1.5 * sum(x[0] for x in X)],
            lambda W: [1.5 * total(W, 0)]),
        "allreduce_average": (
            lambda k: [(5,)],
            lambda x: [hvd.allreduce(x[0], name="ag.avg")],
            lambda X, k: [sum(x[0] for x in X) / n],
            lambda W: [total(W, 0) / n]),
        "allgather_uneven": (
            lambda k: [(rows[k], 2)],
            lambda x: [hvd.allgather(x[0], name="ag.ag")],
            lambda X, k: [torch.cat([x[0] for x in X])],
            lambda W: [(total(W, 0) / n)[mine]]),
        "reducescatter_sum_prescaled": (
            lambda k: [(7, 2)],
            lambda x: [hvd.reducescatter(x[0], op=hvd.Sum, prescale_factor=2.0, name="ag.rs_sum")],
            lambda X, k: [scatter_slice(2.0 * sum(x[0] for x in X), n, k)],
            lambda W: [n * 2.0 * cat(W, 0)]),
        "reducescatter_average": (
            lambda k: [(7, 2)],
            lambda x: [hvd.reducescatter(x[0], op=hvd.Average, name="ag.rs")],
            lambda X, k: [scatter_slice(sum(x[0] for x in X) / n, n, k)],
            lambda W: [cat(W, 0)]),
        "broadcast_from_last_rank": (
            lambda k: [(3, 2)],
            lambda x: [hvd.broadcast(x[0], root_rank=n - 1, name="ag.bc")],
            lambda X, k: [X[n - 1][0]],
            lambda W: [total(W, 0) / n if r == n - 1 else torch.zeros_like(W[0][0])]),
        "grouped_allreduce_average_prescaled": (
            lambda k: [(3,), (2, 2)],
            lambda x: hvd.grouped_allreduce(x, op=hvd.Average, prescale_factor=2.0, name="ag.g_ar"),
            lambda X, k: [2.0 * sum(x[i] for x in X) / n for i in range(2)],
            lambda W: [2.0 * total(W, i) / n for i in range(2)]),
        "grouped_allgather_uneven": (
            lambda k: [(rows[k], 2), (2, 3)],
            lambda x: hvd.grouped_allgather(x, name="ag.g_ag"),
            lambda X, k: [torch.cat([x[i] for x in X]) for i in range(2)],
            lambda W: [(total(W, 0) / n)[mine], (total(W, 1) / n)[2 * r:2 * r + 2]]),
        "grouped_reducescatter_sum": (
            lambda k: [(5, 2), (4,)],
            lambda x: hvd.grouped_reducescatter(x, op=hvd.Sum, name="ag.g_rs"),
            lambda X, k: [scatter_slice(sum(x[i] for x in X), n, k) for i in range(2)],
            lambda W: [n * cat(W, 0), n * cat(W, 1)]),
    }


def _exact(outs, X, W, r):
    """Plain autograd on one process: the gradient of sum_k loss_k for rank r's inputs."""
    Xg = [[t.clone().requires_grad_(True) for t in x] for x in X]
    sum((o * w).sum() for k in range(len(X)) for o, w in zip(outs(Xg, k), W[k])).backward()
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in Xg[r]]  # unused input: zero


def _gradient_errors(convention):
    n, r = hvd.size(), hvd.rank()
    errors = {}
    for seed, (key, (shapes, ours, outs, horovod)) in enumerate(_cases(n, r).items()):
        X = [[make(k, s, "float64", 30 + seed) for s in shapes(k)] for k in range(n)]
        W = [[make(100 + k, o.shape, "float64", 60 + seed) for o in outs(X, k)] for k in range(n)]
        x = [t.clone().requires_grad_(True) for t in X[r]]
        ys = ours(x)
        assert all(y.grad_fn is not None for y in ys), f"{key}: outputs are not differentiable"
        sum((y * w).sum() for y, w in zip(ys, W[r])).backward()
        ref = horovod(W) if convention == "horovod" else _exact(outs, X, W, r)
        errors[key] = max(float((t.grad - g).abs().max()) for t, g in zip(x, ref))
    return errors


def _gradients_with_env_changed_after_init():
    """The convention is the one init() read: setting the variable later changes nothing."""
    os.environ[EXACT_ENV] = "1"
    try:
        return _gradient_errors("horovod")
    finally:
        del os.environ[EXACT_ENV]


def test_default_gradients_are_horovods(ranks):
    for errs in ranks.run(_gradient_errors, "horovod"):
        assert all(e < 1e-12 for e in errs.values()), errs


def test_exact_gradients_opt_in_gives_the_gradient_of_the_summed_losses(exact_ranks):
    for errs in exact_ranks.run(_gradient_errors, "exact"):
        assert all(e < 1e-12 for e in errs.values()), errs


def test_exact_gradients_variable_is_read_at_init_only(ranks):
    for errs in ranks.run(_gradients_with_env_changed_after_init):
        assert all(e < 1e-12 for e in errs.values()), errs


def test_bad_exact_gradients_value_is_refused_at_init_with_the_accepted_values(monkeypatch):
    monkeypatch.setenv(EXACT_ENV, "yes")
    for k in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE"):
        monkeypatch.delenv(k, raising=False)  # were init() to go on, it would be a job of size 1
    try:
        with pytest.raises(ValueError) as e:
            hvd.init()
        assert not hvd.is_initialized()
    finally:
        hvd.shutdown()
    msg = str(e.value)
    # The message of every bad setting (horovod_zero/settings.py): the value, then what is accepted and why.
    assert f"{EXACT_ENV}='yes'" in msg and "expected 1 or 0" in msg and "Horovod's gradients" in msg, msg


def _min_max_backward():
    out = {}
    for key, op in (("min", hvd.Min), ("max", hvd.Max)):
        x = torch.full((3,), float(hvd.rank()), requires_grad=True)
        y = hvd.allreduce(x, op=op, name=f"ag.{key}")  # forward works, as in Horovod
        assert y.tolist() == [0.0 if op == hvd.Min else float(hvd.size() - 1)] * 3
        try:
            y.sum().backward()
            out[key] = None
        except RuntimeError as e:
            out[key] = str(e)
    return out


def test_min_max_allreduce_runs_forward_and_refuses_backward(ranks):
    for msgs in ranks.run(_min_max_backward):
        for msg in msgs.values():
            assert msg is not None and "has no gradient" in msg and "detach()" in msg, msgs
