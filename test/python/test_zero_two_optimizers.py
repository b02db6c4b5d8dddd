"""Two DistributedZeroOptimizers in one job over two models that one loss trains (a
generator and a critic, say): each optimizer names its collectives with its own tag
(hybrid.ShardGroups.tag), so that the gathers and reductions of both, in flight at
once, never share a name, and both models train as plain torch trains them. Before
the tags, the second optimizer's gather was refused on the ranks where the first
one's had not run yet, and the other ranks waited for it. CPU ranks; the CUDA run is
in test/gpu/test_gpu_zero.py."""

import contextlib

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero.torch import enqueue
from harness import shared_pool
from refs import GLOBAL_BATCH, STEPS, adamw, batch, mlp, rank_rows, rel_err


@pytest.fixture
def two_ranks():
    return shared_pool(2)


def _critic(device):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.GELU(), torch.nn.Linear(9, 3)).to(device)


def _target(step, device):
    return torch.randn(GLOBAL_BATCH, 3, generator=torch.Generator().manual_seed(7 + step)).to(device)


def _loss(g, d, x, y):
    return torch.nn.functional.mse_loss(d(g(x)), y)


def _reference():
    g, d = mlp(), _critic("cpu")
    og, od = adamw(g.named_parameters()), adamw(d.named_parameters())
    for step in range(STEPS):
        og.zero_grad()
        od.zero_grad()
        _loss(g, d, batch(step, 0)[0], _target(step, "cpu")).backward()
        od.step()
        og.step()
    return list(g.parameters()) + list(d.parameters())


def _two_optimizers(stage, overlap, device="cpu"):
    """Per parameter of both models, the error against plain torch; the two optimizers'
    tags; the first part of every collective's name that training enqueued."""
    dev = hvd.device() if device == "cuda" else torch.device("cpu")
    g, d = mlp(device=dev), _critic(dev)
    og = hvd.DistributedZeroOptimizer(adamw(g.named_parameters()), model=g, stage=stage, overlap_param_gather=overlap)
    od = hvd.DistributedZeroOptimizer(adamw(d.named_parameters()), model=d, stage=stage, overlap_param_gather=overlap)
    prefixes, enqueue_ = set(), enqueue._enqueue

    def spy(op, ins, outs, names, *args, **kwargs):
        prefixes.update(n.split(".")[0] for n in names)
        return enqueue_(op, ins, outs, names, *args, **kwargs)
    enqueue._enqueue = spy
    try:
        n, r = hvd.size(), hvd.rank()
        for step in range(STEPS):
            x, y = batch(step, 0, dev)[0], _target(step, dev)
            _loss(g, d, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
            od.step()  # the critic's gathers may still run while the generator's are queued
            og.step()
            od.zero_grad()
            og.zero_grad()
        og.wait_for_params()
        od.wait_for_params()
    finally:
        enqueue._enqueue = enqueue_
    with og.gathered_params() if stage == 3 else contextlib.nullcontext(), \
            od.gathered_params() if stage == 3 else contextlib.nullcontext():
        errs = [rel_err(p, q) for p, q in zip(list(g.parameters()) + list(d.parameters()), _reference())]
    return errs, (og._storage.groups.tag, od._storage.groups.tag), prefixes


def check_two_optimizers(pool, stage, overlap, device="cpu"):
    tags = []
    for errs, pair, prefixes in pool.run(_two_optimizers, stage, overlap, device):
        assert all(e < 1e-5 for e in errs), errs
        a, b = pair
        assert a.startswith("zero") and b.startswith("zero") and a != b, pair
        assert prefixes == {a, b}, (prefixes, pair)  # every gather and reduction under its own optimizer's tag
        tags.append(pair)
    assert len(set(tags)) == 1, tags  # the ranks agree on the names without a message


@pytest.mark.parametrize("stage,overlap", [(2, False), (2, True), (3, False)],
                         ids=["stage2", "stage2-overlap-gather", "stage3"])
def test_two_optimizers_in_one_job_name_their_collectives_apart_and_train(two_ranks, stage, overlap):
    check_two_optimizers(two_ranks, stage, overlap)
