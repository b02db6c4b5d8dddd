"""torch.compile and activation checkpointing on CUDA over NCCL: the CPU tests' model
(test_zero_compile.py) with its blocks compiled by inductor (Triton kernels) and
recomputed, at stages 1, 2 and 3, on 1 and 2 GPUs, against the single-process eager
CPU reference, with nothing compiled after warm-up and one graph for all blocks."""

import pytest

import test_zero_compile as zc  # the CPU tests' model, cases and checks
from harness import on_gpus, shared_pool

pytestmark = pytest.mark.gpu

# fp32 throughout; Triton's fused kernels round differently from eager CPU torch, and after 5
# AdamW steps at lr 1e-2 the parameters stay well within this of the reference.
TOL = 1e-4


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


@pytest.mark.parametrize("case", ["stage1-compiled-ac", "stage2-compiled", "stage2-compiled-ac", "stage3-compiled",
                                  "stage3-compiled-after", "stage3-ac", "stage3-compiled-ac"])
def test_compiled_blocks_and_ac_on_cuda(gpus, case):
    stage, how, when, ac = zc.CASES[case]
    zc.check(gpus.run(zc.train_case, stage, how, when, ac, None, False, "cuda", timeout=300),
             compiled=how is not None, tol=TOL)


@pytest.mark.parametrize("case", ["stage2-overlap_param_gather", "stage3-offload", "stage3-no-reshard-after-forward",
                                  "stage3-reshard-root"])
def test_compiled_and_ac_with_options_on_cuda(gpus, case):
    stage, options = zc.OPTION_CASES[case]
    zc.check(gpus.run(zc.train_case, stage, "method", "before", True, options, False, "cuda", timeout=300),
             compiled=True, tol=TOL)
