"""Offload on CUDA: the CPU tests' workers (test_zero_offload.py) with the model on
the GPU and the optimizer on the host, against the single-process CPU reference;
the bytes each step moves between device and host; overlap_step's host step
running before step() is called, while backward still runs; with
overlap_param_gather, its end under the next forward; and a model built on the host,
wrapped with device=, which crosses to the GPU one parameter at a time."""

import pytest
import torch

import horovod_zero.torch as hvd
import test_zero_device as host_built
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


@pytest.mark.parametrize("offload", ["cpu", None], ids=["host", "device"])
@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_step_on_cuda_matches_the_reference(gpus, stage, offload):
    for err, refused in gpus.run(cpu._overlap, stage, "cuda", offload):
        assert err < 1e-5, err
        assert len(refused) == 3, refused


@pytest.mark.parametrize("model_name,stage,offload_params", [("mlp", 2, None), ("tied", 2, None), ("mlp", 3, None),
                                                              ("mlp", 3, "cpu")])
def test_overlap_param_gather_with_overlap_step_on_cuda_matches_torch(gpus, model_name, stage, offload_params):
    for err, positions in gpus.run(cpu._overlap_forward, model_name, "cuda", stage, offload_params):
        assert err < 1e-5, err
        assert positions > 0


@pytest.mark.parametrize("gpus", on_gpus(2), indirect=True)
def test_a_late_step_of_a_branch_a_rank_skipped_is_still_gathered_on_cuda(gpus):
    assert all(diff == 0.0 for diff in gpus.run(cpu._late_worker_for_the_skipped_branch, "cuda", timeout=60))


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
    shard = sum(s.shard for s in opt.sharded_state.shards)  # at stage 3 the parameters are empty at rest
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


@pytest.mark.parametrize("stage,options", [(2, {}), (3, {}), (2, {"offload_optimizer": "cpu"}),
                                           (3, {"offload_optimizer": "cpu", "offload_params": "cpu"})],
                         ids=["stage2", "stage3", "stage2-offload", "stage3-offload-params"])
def test_host_built_model_wrapped_with_device_trains_on_cuda(gpus, stage, options):
    for err, placed, target in gpus.run(host_built._host_built, stage, options):
        assert err < 1e-5, err
        assert target.startswith("cuda") and placed == {target}, (target, placed)


def _wrap_peak(stage, options, layers=16, width=1024):
    """The GPU memory a host-built model's wrap with device= takes at its peak and keeps
    after, against the model's fp32 bytes; then one step, to show that it trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    dev = hvd.device()  # this rank's GPU, which need not be the current one
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, stage=stage,
                                       param_dtype=torch.bfloat16, device=dev,
                                       units=[torch.nn.Linear] if stage == 3 else None, **options)
    torch.cuda.synchronize(dev)
    peak, kept = torch.cuda.max_memory_allocated(dev) - base, torch.cuda.memory_allocated(dev) - base
    x = torch.randn(4, width, device=dev)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.wait_for_params()
    return peak, kept, fp32_bytes, bool(torch.isfinite(loss))


def test_host_built_model_never_sits_whole_on_the_gpu(gpus):
    # Stage 3 with everything offloaded: one parameter crosses at a time and is freed.
    for peak, kept, fp32_bytes, finite in gpus.run(_wrap_peak, 3, {"offload_optimizer": "cpu",
                                                                   "offload_params": "cpu"}):
        assert finite
        assert 0 < peak < fp32_bytes / 4, (peak, fp32_bytes)  # each parameter did cross
        assert kept < fp32_bytes / 16, (kept, fp32_bytes)
    # Stage 2 offloaded: the bf16 parameters stay on the GPU, half the fp32 model's bytes.
    for peak, kept, fp32_bytes, finite in gpus.run(_wrap_peak, 2, {"offload_optimizer": "cpu"}):
        assert finite
        assert fp32_bytes / 2 <= kept and peak < 0.75 * fp32_bytes, (peak, kept, fp32_bytes)


def _host_group_added():
    """A module built on the host after wrapping, added with add_param_group: it crosses too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, stage=2,
                                       device=hvd.device())
    head = torch.nn.Linear(64, 8)
    head.register_buffer("unused", torch.ones(8))
    model.append(head)
    opt.add_param_group({"params": list(head.parameters())})
    placed = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    before = head.weight.detach().clone()
    model(torch.randn(4, 64, device=hvd.device())).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return placed, str(torch.device(hvd.device())), bool((head.weight != before).any())


def test_group_added_from_the_host_crosses_too(gpus):
    for placed, target, moved in gpus.run(_host_group_added):
        assert placed == {target}, (placed, target)
        assert moved


def _host_built_refusals():
    """What device= refuses before anything moves, and where an index-less 'cuda' trains."""
    out = {}
    model = host_built.WithBuffer()
    model(torch.randn(2, 16)).sum().backward()  # a gradient on the host, from before wrapping
    try:
        hvd.DistributedZeroOptimizer(host_built._inner(model), model=model, device=hvd.device())
    except ValueError as e:
        out["early_grad"] = str(e)
    model = host_built.WithBuffer()
    try:  # refused by the offload's checks, after the device was resolved
        hvd.DistributedZeroOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                                     model=model, device=hvd.device(), offload_optimizer="cpu", overlap_step=True)
    except ValueError as e:
        out["refused"] = str(e)
    out["left_on_host"] = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    model = host_built.WithBuffer()
    hvd.DistributedZeroOptimizer(host_built._inner(model), model=model, device="cuda")
    out["cuda"] = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    out["local"] = str(hvd.device())
    return out


def test_device_refuses_before_moving_and_cuda_means_this_ranks_gpu(gpus):
    for out in gpus.run(_host_built_refusals):
        assert "zero_grad(set_to_none=True)" in out["early_grad"], out
        assert "overlap_step" in out["refused"], out
        assert out["left_on_host"] == {"cpu"}, out  # the refused wrap moved nothing
        assert out["cuda"] == {out["local"]}, out
