"""DistributedZeroOptimizer on CUDA over NCCL: the CPU tests' math with the model on
each rank's GPU, against the single-process reference on the CPU (fp32 to 1e-5,
bf16 parameters with bf16 on the wire). Every test runs as a job of 1 rank on one
GPU and of 2 ranks on two, except the checkpoint saved on 2, which needs two."""

import pytest
import torch

import horovod_zero.torch as hvd
import test_zero as cpu  # the CPU tests' workers, run here with device="cuda"
import test_zero_step_chunks as chunks
import test_zero_two_optimizers as two
from harness import launch, on_gpus, shared_pool
from refs import STEPS, adamw, batch, mlp, mse, rank_rows, rel_err, train_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


def _zero_on_gpu(stage, mode):
    passes = {"plain": 1, "coalesce": 4, "overlap": 1}[mode]
    model = mlp(device=hvd.device())
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage,
                                       overlap_param_gather=mode == "overlap")
    cpu._train(model, opt, passes, mode, 0.05)
    opt.wait_for_params()  # the forward hooks waited in every step but the last
    on_cuda = all(p.is_cuda for p in model.parameters())
    ref, _ = train_reference(passes, 0.05)
    return on_cuda, [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "coalesce", "overlap"])
def test_zero_on_cuda_matches_the_reference(gpus, stage, mode):
    for on_cuda, errs in gpus.run(_zero_on_gpu, stage, mode):
        assert on_cuda
        assert all(e < 1e-5 for e in errs), errs


@pytest.mark.parametrize("stage,kwargs", [(1, {}), (2, {}), (2, dict(overlap_param_gather=True)), (3, {})],
                         ids=["stage1", "stage2", "stage2-overlap-gather", "stage3"])
@pytest.mark.parametrize("master_adam", [False, True], ids=["cast", "uncast"])
def test_the_step_in_chunks_on_cuda_gives_the_whole_steps_values(gpus, stage, kwargs, master_adam):
    """With torch's fused AdamW after the cast, chunk by chunk: bit for bit. From the uncast
    reduced gradients (csrc/cuda/master_adam.cu; fp32 for this fp32 model, and clipping
    would cast them, so that variant does not clip): torch's update to fp32 rounding. The
    kernel on bf16/fp16 gradients: test_gpu_master_adam.py."""
    clip = None if master_adam else 0.05
    for whole_chunks, n_chunks, same, diff, err in gpus.run(chunks._chunked_against_whole, stage, clip, kwargs,
                                                            "cuda", master_adam):
        assert whole_chunks == [(0, 0)] * STEPS and all(c >= 3 for c, _ in n_chunks), (whole_chunks, n_chunks)
        if master_adam:
            assert all(u > 0 for _, u in n_chunks), n_chunks
            assert diff < 1e-5, diff
        else:
            assert all(same) and all(u == 0 for _, u in n_chunks), (same, n_chunks)
        assert err < 1e-5, err


@pytest.mark.parametrize("stage,overlap,clip", [(2, False, None), (2, True, None), (3, False, None), (2, False, 0.05)],
                         ids=["stage2", "stage2-overlap-gather", "stage3", "stage2-clip-scaled"])
def test_two_optimizers_in_one_job_on_cuda(gpus, stage, overlap, clip):
    """Their gathers and reductions in flight at once, each under its own tag."""
    two.check_two_optimizers(gpus, stage, overlap, clip, device="cuda")


@pytest.mark.parametrize("stage,mode", [(1, "bpps"), (2, "bpps"), (2, "perpass")])
def test_accumulation_modes_on_cuda_match_the_reference(gpus, stage, mode):
    for errs, counts, _ in gpus.run(cpu._check_against_reference, stage, mode, None, "cuda"):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert counts == [4 * (3 if mode == "perpass" and stage == 2 else 1)] * STEPS, counts


def test_tied_frozen_and_gradless_parameters_on_cuda(gpus):
    for errs, frozen_same, unused_same in gpus.run(cpu._tied_frozen_unused, "cuda"):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert frozen_same and unused_same


def test_fp16_overflow_skips_the_step_on_cuda(gpus):
    for skipped, scale0, scale1, errs in gpus.run(cpu._fp16_loss_scaling, "cuda"):
        assert skipped and scale1 == scale0 * 0.5
        assert all(e < 5e-3 for e in errs), errs


@pytest.mark.parametrize("saved_on", on_gpus(1, 2))
def test_consolidated_checkpoint_saved_on_gpus_resumes_on_1(tmp_path, saved_on):
    path = str(tmp_path / "ckpt.pt")
    res = launch(cpu._save, saved_on, path, 2, "cuda", timeout=180)
    assert sorted(res) == list(range(saved_on)) and all(s == "ok" for s, _ in res.values()), res
    res = launch(cpu._resume, 1, path, 2, 2, "cuda", timeout=180)
    assert sorted(res) == [0] and all(s == "ok" for s, _ in res.values()), res
    ref, _ = train_reference(1, None, steps=4)  # on CPU, never stopped
    params = {n: torch.tensor(v) for n, v in res[0][1].items()}
    for n, q in ref.named_parameters():
        assert rel_err(params[n], q) < 1e-5, (n, rel_err(params[n], q))


def _bf16_on_gpu():
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    model = mlp(device=dev)
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2,
                                       param_dtype=torch.bfloat16)
    x, y = batch(0, 0, dev)
    mse(model, rank_rows(x, r, n).bfloat16(), rank_rows(y, r, n).bfloat16()).backward()
    hvd.collective_stats(reset=True)
    opt.step()
    return sorted({(s["op"], s["device"], s["dtype"]) for s in hvd.collective_stats() if s["op"] == "allgather"})


def test_bf16_crosses_the_wire_on_cuda(gpus):
    assert gpus.run(_bf16_on_gpu) == [[("allgather", "cuda", "bfloat16")]] * gpus.size
