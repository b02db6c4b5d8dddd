"""Horovod's arithmetic for prescale_factor, postscale_factor and op=Average on
floating-point tensors, in plain torch, for test_scale_factors.py and its GPU twin.

From Horovod's source (horovod/common/ops): each scaling is one pass of ScaleBuffer
over the tensor in its own dtype: fp64 multiplies by the factor in double; fp32 by
(float) factor in float; fp16 on the CPU in float with (float) factor, rounded once
to fp16; fp16 on the GPU in fp16 with the factor first rounded to fp16. Average
divides by adding 1/size to the postscale (in double) and scaling after the sum,
except an NCCL allreduce, which uses ncclAvg: NCCL multiplies each rank's input by
(dtype)(1/size) before summing. Horovod has no bf16; ours scales it like the CPU's
fp16 (in float, (float) factor, one rounding), on NCCL too, and averages it after
the sum.

Inputs are the same on every rank, so that the sum (y + y + ...) has one order.
"""

import torch


def scale(x, factor, nccl):
    """One ScaleBuffer pass over x, in x's dtype."""
    if factor == 1.0:
        return x
    if x.dtype == torch.float64:
        return x * factor
    f = torch.tensor(factor, dtype=torch.float64).float()  # (float) factor
    if nccl and x.dtype == torch.float16:
        f = f.half().float()  # __float2half((float) factor); fp16 * fp16 is exact in float
    return (x.float() * f).to(x.dtype)


def _sum(y, n):
    acc = y
    for _ in range(n - 1):
        acc = acc + y  # in y's dtype, one rounding per addition
    return acc


def reduced(x, n, op_name, pre, post, allreduce, nccl, nccl_avg=None):
    """Every rank's result of allreduce (allreduce=True) or the whole tensor that a
    reducescatter splits, for x on each of n ranks. `nccl_avg`: NCCL's own average of
    a tensor over the ranks (every rank calls it in the same order); without it, a
    model of ncclAvg as a premultiplied sum, which matched NCCL at two ranks but not at
    three (by one ulp: NCCL's rounding inside its kernels is its own)."""
    y = scale(x, pre, nccl)
    if op_name == "Average" and nccl and allreduce and x.dtype != torch.bfloat16:
        return scale(nccl_avg(y) if nccl_avg else _sum(scale(y, 1.0 / n, nccl), n), post, nccl)  # ncclAvg
    if op_name == "Average":
        post = post / n
    return scale(_sum(y, n), post, nccl)


def assert_equal(out, ref, what):
    out = out.cpu()
    assert out.dtype == ref.dtype, (what, out.dtype, ref.dtype)
    if not torch.equal(out, ref):
        diff = (out.double() - ref.double()).abs()
        raise AssertionError(f"{what}: {int((diff > 0).sum())} of {diff.numel()} elements differ from Horovod's "
                             f"arithmetic, by up to {diff.max().item():.3g}")
