"""Offload on CUDA: the CPU tests' workers (test_zero_offload.py) with the model on
the GPU and the optimizer on the host, against the single-process CPU reference;
the bytes each step moves between device and host; overlap_step's host step
running before step() is called, while backward still runs; and with
overlap_param_gather, its end under the next forward."""

import pytest
import torch

import horovod_zero.torch as hvd
import test_zero_offload as cpu
from harness import on_gpus, shared_pool

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


@pytest.mark.parametrize("stage,offload_params", [(1, None), (2, None), (3, None), (3, "cpu")])
def test_offload_on_cuda_matches_the_reference(gpus, stage, offload_params):
    for rank_out in gpus.run(cpu._parity, stage, "adamw", offload_params, "cuda"):
        for mode, err, step, state_off_host in rank_out:
            assert err < 1e-5, (mode, err)
            assert not state_off_host
            assert step.startswith("C++ AdamW"), step


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_step_on_cuda_matches_the_reference(gpus, stage):
    for err, refused in gpus.run(cpu._overlap, stage, "cuda"):
        assert err < 1e-5, err
        assert len(refused) == 2, refused


@pytest.mark.parametrize("model_name,stage,offload_params", [("mlp", 2, None), ("tied", 2, None), ("mlp", 3, None),
                                                              ("mlp", 3, "cpu")])
def test_overlap_param_gather_with_overlap_step_on_cuda_matches_torch(gpus, model_name, stage, offload_params):
    for err, positions in gpus.run(cpu._overlap_forward, model_name, "cuda", stage, offload_params):
        assert err < 1e-5, err
        assert positions > 0


def _traffic(stage, overlap, layers=6, width=1024, gather_overlap=False):
    """Bytes per step each way, and how many shards were stepped before step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(hvd.device())
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, stage=stage,
                                       param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       offload_optimizer="cpu", overlap_step=overlap,
                                       overlap_param_gather=gather_overlap,
                                       units=[torch.nn.Linear] if stage == 3 else None)
    x = torch.randn(64, width, device=hvd.device())
    steps = 3
    for _ in range(steps):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    torch.cuda.synchronize()
    stats = opt.offload_stats()
    shard = sum(s.shard for s in opt._shards)  # at stage 3 the parameters are empty at rest
    return stats, shard, steps


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_moves_one_bf16_shard_each_way_per_step(gpus, stage):
    for stats, shard, steps in gpus.run(_traffic, stage, False):
        # bf16 gradient shards down, bf16 parameter shards up, once per step; at stage 3 the
        # shard at rest stays on the device, so the gathers read it there.
        assert stats["d2h_bytes"] == 2 * shard * steps, stats
        assert stats["h2d_bytes"] == 2 * shard * steps, stats


@pytest.mark.parametrize("stage", [2, 3])
def test_host_step_under_the_next_forward_moves_one_bf16_shard_each_way_per_step(gpus, stage):
    # The copies back are made as the worker steps; the gathers in the forward read them.
    for stats, shard, steps in gpus.run(_traffic, stage, True, 6, 1024, True):
        assert stats["d2h_bytes"] == 2 * shard * steps, stats
        assert stats["h2d_bytes"] == 2 * shard * steps, stats


def test_overlap_step_steps_shards_while_backward_runs(gpus):
    for stats, shard, steps in gpus.run(_traffic, 2, True, 24, 2048):
        assert stats["stepped_before_step"] > 0, stats


def test_nvme_offload_on_cuda_matches_the_reference(gpus, tmp_path):
    for rank_out in gpus.run(cpu._parity, 3, "adamw", None, "cuda", str(tmp_path)):
        for mode, err, step, _ in rank_out:
            assert err < 1e-5, (mode, err)
            assert step.endswith("on NVMe"), step
