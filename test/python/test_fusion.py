"""Fusion and the response cache, proven by counting collectives."""

import torch

import horovod_zero.torch as hvd
from harness import shared_pool as pool


def _many_small(tag):
    hvd.collective_stats(reset=True)
    n = 200
    hs = [hvd.allreduce_async(torch.full((10,), float(i)), op=hvd.Sum, name=f"{tag}.{i}") for i in range(n)]
    outs = hvd.synchronize(hs)
    for i, o in enumerate(outs):
        assert torch.equal(o, torch.full((10,), float(i * hvd.size())))
    (stat,) = hvd.collective_stats()
    return stat["collectives"], stat["tensors"]


def test_many_small_async_ops_fuse_into_few_collectives():
    calls, tensors = pool(2).run(_many_small, "fused")[0]
    assert tensors == 200
    assert calls <= 10, f"200 small tensors took {calls} collectives"


def test_without_fusion_every_tensor_is_its_own_collective():
    calls, tensors = pool(2, fusion=False).run(_many_small, "unfused")[0]
    assert (calls, tensors) == (200, 200)


def _grouped_is_one_collective():
    hvd.collective_stats(reset=True)
    hvd.grouped_allgather([torch.ones(i + 1, 3) for i in range(50)], name="grouped_count")
    (stat,) = hvd.collective_stats()
    return stat["collectives"]


def test_a_group_is_negotiated_and_fused_together():
    assert pool(3).run(_grouped_is_one_collective) == [1, 1, 1]


def _repeat_uses_cache():
    tensors = [torch.ones(5) for _ in range(30)]
    hvd.grouped_allreduce(tensors, name="cached")  # first time: the slow path
    before = hvd.runtime_info()["slow_path_cycles"]
    for _ in range(5):
        hvd.grouped_allreduce(tensors, name="cached")
    return hvd.runtime_info()["slow_path_cycles"] - before


def test_repeated_tensors_skip_the_coordinator():
    assert pool(2).run(_repeat_uses_cache) == [0, 0]
