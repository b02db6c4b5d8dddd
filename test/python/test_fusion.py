"""Fusion and the response cache, proven by counting collectives."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import shared_pool as pool
from refs import make, reduce_ref, scatter_slice


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


CHUNKED = {"HOROVOD_FUSION_CHUNK_BYTES": "4096"}


def _chunked_ops(device="cpu"):
    """Fused allgathers and reducescatters above HOROVOD_FUSION_CHUNK_BYTES run as
    several collectives, one per chunk of whole tensors, each in its own region of
    the buffer: uneven dim 0, casts and scales must land as in one piece."""
    n, r = hvd.size(), hvd.rank()
    rows = [1, 7, 300, 2, 513, 64, 5, 1000, 3, 33]
    ins = [[make(k, (d + (i + k) % 3, 3), "float32", 40 + i) for i, d in enumerate(rows)] for k in range(n)]
    mine = [t.to(device) for t in ins[r]]
    hvd.collective_stats(reset=True)
    for odt in (None, torch.bfloat16):
        out = hvd.grouped_allgather(mine, output_dtype=odt, name=f"chunked.ag.{odt}")
        for i, o in enumerate(out):
            ref = torch.cat([ins[k][i] for k in range(n)])
            assert torch.equal(o.cpu(), ref if odt is None else ref.to(odt)), i
    fulls = [[make(k, (d, 3), "float32", 60 + i) for i, d in enumerate(rows)] for k in range(n)]
    out = hvd.grouped_reducescatter([t.to(device) for t in fulls[r]], op=hvd.Average, prescale_factor=0.5,
                                    name="chunked.rs")
    for i, o in enumerate(out):
        ref = scatter_slice(0.5 * reduce_ref([fulls[k][i] for k in range(n)], "Average"), n, r)
        torch.testing.assert_close(o.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    totals = {}
    for s in hvd.collective_stats():  # allgather: one row per wire dtype
        calls, tensors = totals.get(s["op"], (0, 0))
        totals[s["op"]] = (calls + s["collectives"], tensors + s["tensors"])
    return totals


@pytest.mark.parametrize("size", [2, 3])
def test_fused_ops_over_the_chunk_size_run_in_chunks(size):
    for stats in pool(size, env=CHUNKED).run(_chunked_ops):
        ag_calls, ag_tensors = stats["allgather"]
        rs_calls, rs_tensors = stats["reducescatter"]
        assert (ag_tensors, rs_tensors) == (20, 10)
        assert 4 < ag_calls < 20 and 1 < rs_calls < 10, stats  # chunks of several tensors, not one call
