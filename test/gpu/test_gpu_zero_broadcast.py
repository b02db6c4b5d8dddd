"""hvd.broadcast_optimizer_state() of a DistributedZeroOptimizer on CUDA over NCCL: the CPU
tests' workers (test/python/test_zero_broadcast.py) with the model on each rank's GPU,
against the single-process reference on the CPU."""

import pytest

import test_zero_broadcast as cpu
from harness import on_gpus, shared_pool

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_horovods_boilerplate_broadcast_on_cuda(gpus, stage):
    for fresh, errs in gpus.run(cpu._synthetic_benchmark, stage, "cuda"):
        assert fresh and max(errs) < 1e-5, errs


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("source,where", [("torch", None), ("consolidated", None),
                                          ("torch", {"offload_optimizer": "cpu"})],
                         ids=["torch", "consolidated", "torch-cpu-offload"])
def test_rank_0_loads_a_checkpoint_then_broadcasts_on_cuda(gpus, stage, source, where):
    for matches, errs in gpus.run(cpu._resume_after_broadcast, stage, source, where, None, False, "cuda"):
        assert matches, "a rank's optimizer state is not its shard of the root's"
        assert max(errs) < 1e-5, errs
