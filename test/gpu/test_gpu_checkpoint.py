"""Large-model features on CUDA over NCCL: a model built on the meta device and made
real unit by unit on the GPU gets the values of a normal build on the GPU; sharded DCP
checkpoints saved from GPU shards at stage 3 load back at stage 3 and stage 2,
synchronously and asynchronously, to the same weights."""

import os
import tempfile

import pytest
import torch

import horovod_zero.torch as hvd
import test_zero_meta_init as mi  # the CPU tests' model (tied head, RoPE buffer, batch norm)
from harness import on_gpus, shared_pool

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


def _wrap(model, stage):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return hvd.DistributedZeroOptimizer(opt, model=model, stage=stage, device=hvd.device())


def _train(model, opt, steps):
    dev, n, r = hvd.device(), hvd.size(), hvd.rank()
    k = mi.BATCH // n
    for step in range(steps):
        ids, target = (t[r * k:(r + 1) * k].to(dev) for t in mi.batch(step))
        torch.nn.functional.cross_entropy(model(ids).reshape(-1, mi.VOCAB), target.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt):
    if opt.stage != 3:
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with opt.gathered_params():
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _meta_on_cuda():
    model = mi.build(meta=True)
    opt = _wrap(model, 3)
    with torch.device(hvd.device()):
        normal = mi.build(meta=False)
    opt_n = _wrap(normal, 3)
    masters = all(torch.equal(a, b) for a, b in zip(opt._storage.master_params, opt_n._storage.master_params))
    on_gpu = all(t.device.type == "cuda" for t in list(model.parameters()) + list(model.buffers()))
    return masters, on_gpu


def test_meta_init_onto_the_gpu_gives_a_normal_builds_values(gpus):
    for masters, on_gpu in gpus.run(_meta_on_cuda):
        assert masters and on_gpu


def _round_trip(path, blocking, stage_after):
    model = mi.build(meta=False).to(hvd.device())
    opt = _wrap(model, 3)
    _train(model, opt, 2)
    saved = _full(model, opt)
    if blocking:
        hvd.zero.save_checkpoint(path, model, opt)
    else:
        handle = hvd.zero.async_save_checkpoint(path, model, opt)
        _train(model, opt, 1)
        handle.wait()
    model2 = mi.build(meta=False, seed=3).to(hvd.device())
    opt2 = _wrap(model2, stage_after)
    hvd.zero.load_checkpoint(path, model2, opt2)
    loaded = _full(model2, opt2)
    return all(torch.equal(saved[n], loaded[n]) for n in saved)


@pytest.mark.parametrize("blocking,stage_after", [(True, 3), (True, 2), (False, 3)],
                         ids=["save-stage3", "save-stage2", "async-stage3"])
def test_dcp_checkpoints_of_gpu_shards_load_back(gpus, blocking, stage_after):
    path = os.path.join(tempfile.gettempdir(), f"hvdz_gpu_ckpt_{os.getpid()}_{blocking}_{stage_after}")
    assert all(gpus.run(_round_trip, path, blocking, stage_after))
