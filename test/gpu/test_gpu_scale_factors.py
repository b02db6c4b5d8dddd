"""prescale_factor, postscale_factor and op=Average on CUDA tensors over NCCL, bit for
bit against Horovod's GPU arithmetic (test/python/scale_refs.py): fp16 scales in fp16
with the factor rounded to fp16, and an allreduce's Average is NCCL's ncclAvg, which the
reference takes from NCCL itself through torch.distributed (ReduceOp.AVG). The
same cases as test/python/test_scale_factors.py: a lone tensor, fused groups with
even and uneven splits, a direct group; once more with direct groups off, so the
large tensors go through the fusion buffer."""

import tempfile

import pytest
import torch.distributed as dist

import horovod_zero.torch as hvd
from harness import on_gpus, shared_pool
from refs import FLOATS
from test_scale_factors import exact_scaling

pytestmark = pytest.mark.gpu


def _nccl_avg(y):
    """Plain torch's NCCL average of y over the ranks."""
    out = y.to(hvd.device())
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return out.cpu()


def _on_gpu(dtype_name):
    assert hvd.device().type == "cuda"
    # A process group beside the runtime, for the reference only; gone after the test, as
    # the rank processes serve other tests.
    where = hvd.broadcast_object(tempfile.mktemp(prefix="hvdz_scale_") if hvd.rank() == 0 else None, 0)
    dist.init_process_group("nccl", init_method=f"file://{where}", rank=hvd.rank(), world_size=hvd.size(),
                            device_id=hvd.device())
    try:
        exact_scaling(dtype_name, nccl=True, device=hvd.device(), nccl_avg=_nccl_avg)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffer"])
@pytest.mark.parametrize("size", on_gpus(2, 3))
@pytest.mark.parametrize("dtype_name", FLOATS)
def test_gpu_scale_factors_match_horovod_bit_for_bit(size, dtype_name, direct):
    env = None if direct else {"HOROVOD_ZERO_DIRECT_MAX_TENSORS": "0"}
    shared_pool(size, env=env).run(_on_gpu, dtype_name)
