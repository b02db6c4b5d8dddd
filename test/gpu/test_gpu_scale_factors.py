"""prescale_factor, postscale_factor and op=Average on CUDA tensors over NCCL, bit for
bit against Horovod's GPU arithmetic (test/python/scale_refs.py): fp16 scales in fp16
with the factor rounded to fp16, and an allreduce's Average is NCCL's ncclAvg. The
same cases as test/python/test_scale_factors.py: a lone tensor, fused groups with
even and uneven splits, a direct group; once more with direct groups off, so the
large tensors go through the fusion buffer."""

import pytest

import horovod_zero.torch as hvd
from harness import on_gpus, shared_pool
from refs import FLOATS
from test_scale_factors import exact_scaling

pytestmark = pytest.mark.gpu


def _on_gpu(dtype_name):
    assert hvd.device().type == "cuda"
    exact_scaling(dtype_name, nccl=True, device=hvd.device())


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffer"])
@pytest.mark.parametrize("size", on_gpus(2, 3))
@pytest.mark.parametrize("dtype_name", FLOATS)
def test_gpu_scale_factors_match_horovod_bit_for_bit(size, dtype_name, direct):
    env = None if direct else {"HOROVOD_ZERO_DIRECT_MAX_TENSORS": "0"}
    shared_pool(size, env=env).run(_on_gpu, dtype_name)
