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
from harness import launch, shared_pool
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


def _reference(clip):
    g, d = mlp(), _critic("cpu")
    og, od = adamw(g.named_parameters()), adamw(d.named_parameters())
    for step in range(STEPS):
        og.zero_grad()
        od.zero_grad()
        _loss(g, d, batch(step, 0)[0], _target(step, "cpu")).backward()
        if clip:  # each optimizer clips its own parameters' norm
            torch.nn.utils.clip_grad_norm_(d.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(g.parameters(), clip)
        od.step()
        og.step()
    return list(g.parameters()) + list(d.parameters())


def _two_optimizers(stage, overlap, clip, device="cpu"):
    """Per parameter of both models, the error against plain torch; the two optimizers'
    tags; the first part of the name of every collective that training enqueued. `clip`:
    each optimizer clips its gradients' norm, with loss scaling (a norm and an overflow
    check each, by name)."""
    dev = hvd.device() if device == "cuda" else torch.device("cpu")
    # One optimizer first, so that neither tag below is the job's first ("zero").
    first = mlp()
    hvd.DistributedZeroOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), model=first, stage=2)
    g, d = mlp(device=dev), _critic(dev)
    scaling = dict(loss_scaler=hvd.zero.LossScaler(scale=256.0)) if clip else {}
    og = hvd.DistributedZeroOptimizer(adamw(g.named_parameters()), model=g, stage=stage, overlap_param_gather=overlap,
                                      **scaling)
    scaling = dict(loss_scaler=hvd.zero.LossScaler(scale=256.0)) if clip else {}
    od = hvd.DistributedZeroOptimizer(adamw(d.named_parameters()), model=d, stage=stage, overlap_param_gather=overlap,
                                      **scaling)
    prefixes, spied = set(), (enqueue._enqueue, enqueue._enqueue_one)

    def spy_many(op, ins, outs, names, *args, **kwargs):
        prefixes.update(n.split(".")[0] for n in names)
        return spied[0](op, ins, outs, names, *args, **kwargs)

    def spy_one(op, tensor, output, name, *args, **kwargs):
        prefixes.add(name.split(".")[0])
        return spied[1](op, tensor, output, name, *args, **kwargs)
    enqueue._enqueue, enqueue._enqueue_one = spy_many, spy_one
    try:
        n, r = hvd.size(), hvd.rank()
        for step in range(STEPS):
            x, y = batch(step, 0, dev)[0], _target(step, dev)
            loss = _loss(g, d, rank_rows(x, r, n), rank_rows(y, r, n))
            (og.scale_loss(loss) if clip else loss).backward()  # both scalers hold the same scale
            if clip:
                od.clip_grad_norm_(clip)
                og.clip_grad_norm_(clip)
            od.step()  # the critic's gathers may still run while the generator's are queued
            og.step()
            od.zero_grad()
            og.zero_grad()
        og.wait_for_params()
        od.wait_for_params()
    finally:
        enqueue._enqueue, enqueue._enqueue_one = spied
    with og.gathered_params() if stage == 3 else contextlib.nullcontext(), \
            od.gathered_params() if stage == 3 else contextlib.nullcontext():
        errs = [rel_err(p, q) for p, q in zip(list(g.parameters()) + list(d.parameters()), _reference(clip))]
    return errs, (og._storage.groups.tag, od._storage.groups.tag), prefixes


def check_two_optimizers(pool, stage, overlap, clip=None, device="cpu"):
    tags = []
    for errs, pair, prefixes in pool.run(_two_optimizers, stage, overlap, clip, device):
        assert all(e < 1e-5 for e in errs), errs
        a, b = pair
        assert a.startswith("zero") and b.startswith("zero") and len({a, b, "zero"}) == 3, pair
        assert prefixes == {a, b}, (prefixes, pair)  # every collective under its own optimizer's tag
        tags.append(pair)
    assert len(set(tags)) == 1, tags  # the ranks agree on the names without a message


@pytest.mark.parametrize("stage,overlap,clip", [(2, False, None), (2, True, None), (3, False, None),
                                                (2, False, 0.05), (3, False, 0.05)],
                         ids=["stage2", "stage2-overlap-gather", "stage3", "stage2-clip-scaled", "stage3-clip-scaled"])
def test_two_optimizers_in_one_job_name_their_collectives_apart_and_train(two_ranks, stage, overlap, clip):
    check_two_optimizers(two_ranks, stage, overlap, clip)


def _rejoined():
    """Two optimizers, then a new job (hvd.shutdown() and hvd.init(), as hvd.elastic does)
    in which they rejoin in the other order, then a third optimizer. Each one's tag
    before and after, and the third's."""
    hvd.init()
    g, d = mlp(), _critic("cpu")
    og = hvd.DistributedZeroOptimizer(adamw(g.named_parameters()), model=g, stage=2)
    od = hvd.DistributedZeroOptimizer(adamw(d.named_parameters()), model=d, stage=2)
    before = og._storage.groups.tag, od._storage.groups.tag
    hvd.barrier()
    hvd.shutdown()
    hvd.init()
    od._rejoin()  # TorchState's order need not be the order the script built them in
    og._rejoin()
    after = og._storage.groups.tag, od._storage.groups.tag
    m = mlp()
    third = hvd.DistributedZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, stage=2)
    tag = third._storage.groups.tag
    hvd.barrier()
    hvd.shutdown()
    return before, after, tag


def test_an_optimizer_keeps_its_tag_when_it_rejoins_a_new_job_and_later_ones_count_on():
    """A worker that joins the new job builds them in the script's order, and names them
    as they were named before: the survivors must not renumber them."""
    res = launch(_rejoined, 2)
    assert sorted(res) == [0, 1] and all(s == "ok" for s, _ in res.values()), res
    for _, (before, after, third) in res.values():
        assert before == after == ("zero", "zero1"), (before, after)
        assert third == "zero2", third
