"""DistributedZeroOptimizer on CUDA over NCCL: the CPU reference tests' math with
the model on each rank's GPU (fp32 against the single-process reference to 1e-5,
bf16 parameters with bf16 on the wire)."""

import contextlib

import pytest
import torch

import horovod_zero.torch as hvd
import test_zero as cpu  # the CPU tests' model, batches and reference
from harness import launch, shared_pool

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpus():
    return shared_pool(2)


def _zero_on_gpu(stage, mode):
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    passes = {"plain": 1, "coalesce": 4, "overlap": 1}[mode]
    model = cpu._model().to(dev)
    opt = hvd.DistributedZeroOptimizer(cpu._adamw(model), model=model, stage=stage,
                                       overlap_param_gather=mode == "overlap")
    local = cpu.GLOBAL_BATCH // n
    for step in range(cpu.STEPS):
        ctx = opt.coalesce_grad_reduction() if mode == "coalesce" else contextlib.nullcontext()
        with ctx:
            for micro in range(passes):
                x, y = cpu._batch(step, micro)
                cpu._loss(model, x[r * local:(r + 1) * local].to(dev), y[r * local:(r + 1) * local].to(dev)).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()  # the forward hooks waited in every step but the last
    ref, _ = cpu._reference(passes, 0.05)
    return [cpu._rel(p.cpu(), q) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode", ["plain", "coalesce", "overlap"])
def test_zero_on_cuda_matches_the_reference(gpus, stage, mode):
    for errs in gpus.run(_zero_on_gpu, stage, mode):
        assert all(e < 1e-5 for e in errs), errs


def _on_gpu(fn, *args):
    """Runs one of the CPU tests' workers with its models and batches on this rank's GPU."""
    cpu.DEVICE = hvd.device()
    try:
        return fn(*args)
    finally:
        cpu.DEVICE = torch.device("cpu")


@pytest.mark.parametrize("stage,mode", [(1, "bpps"), (2, "bpps"), (2, "perpass")])
def test_accumulation_modes_on_cuda_match_the_reference(gpus, stage, mode):
    for errs, counts, _ in gpus.run(_on_gpu, cpu._check_against_reference, stage, mode, None):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert counts == [4 * (3 if mode == "perpass" and stage == 2 else 1)] * cpu.STEPS, counts


def test_tied_frozen_and_gradless_parameters_on_cuda(gpus):
    for errs, frozen_same, unused_same in gpus.run(_on_gpu, cpu._tied_frozen_unused):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert frozen_same and unused_same


def test_fp16_overflow_skips_the_step_on_cuda(gpus):
    for skipped, scale0, scale1, errs in gpus.run(_on_gpu, cpu._fp16_loss_scaling):
        assert skipped and scale1 == scale0 * 0.5
        assert all(e < 5e-3 for e in errs), errs


def _in_fresh_process_on_gpu(fn, *args):
    hvd.init()  # fn's own init() then does nothing
    cpu.DEVICE = hvd.device()
    return fn(*args)


def test_consolidated_checkpoint_saved_on_2_gpus_resumes_on_1(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    res = launch(_in_fresh_process_on_gpu, 2, cpu._save, path, 2, timeout=180)
    assert all(s == "ok" for s, _ in res.values()), res
    res = launch(_in_fresh_process_on_gpu, 1, cpu._resume, path, 2, 2, timeout=180)
    assert all(s == "ok" for s, _ in res.values()), res
    ref, _ = cpu._reference(1, None, steps=4)  # on CPU, never stopped
    params = {n: torch.tensor(v) for n, v in res[0][1].items()}
    for n, q in ref.named_parameters():
        assert cpu._rel(params[n], q) < 1e-5, (n, cpu._rel(params[n], q))


def _bf16_on_gpu():
    dev = hvd.device()
    model = cpu._model().to(dev)
    opt = hvd.DistributedZeroOptimizer(cpu._adamw(model), model=model, stage=2, param_dtype=torch.bfloat16)
    r, local = hvd.rank(), cpu.GLOBAL_BATCH // hvd.size()
    x, y = cpu._batch(0, 0)
    cpu._loss(model, x[r * local:(r + 1) * local].to(dev).bfloat16(), y[r * local:(r + 1) * local].to(dev).bfloat16()).backward()
    hvd.collective_stats(reset=True)
    opt.step()
    return sorted({(s["op"], s["device"], s["dtype"]) for s in hvd.collective_stats() if s["op"] == "allgather"})


def test_bf16_crosses_the_wire_on_cuda(gpus):
    assert gpus.run(_bf16_on_gpu) == [[("allgather", "cuda", "bfloat16")]] * 2
