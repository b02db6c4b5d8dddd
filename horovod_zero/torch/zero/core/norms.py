"""The global gradient norm and the overflow check, for gradient shards wherever
they are (fp32 masters' .grad on the device, reduced-dtype shards on the host):
one local reduction, one allreduce. The step strategies call these."""

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.basics import _core


def global_norm(grads, process_set, device, scale=1.0, order_after=None, *, tag):
    """The L2 norm of every rank's `grads` (over `process_set`, the ranks that hold one
    copy of every shard), times `scale`, as a 0-dim fp64 tensor. fp32 math per tensor
    (bf16 shards too), fp64 across tensors and ranks. `device`: where the allreduce
    runs (the parameters' device: NCCL on GPUs; the host: Gloo). `order_after(handle)`:
    instead of waiting for the allreduce, order the current stream after it. `tag`: the
    optimizer's (hybrid.ShardGroups.tag), which names the allreduce."""
    local = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        local += torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).double().pow(2).sum().to(device)
    # In place: `local` holds the sum once the stream is ordered after the allreduce.
    handle = ops._enqueue_one(_core.OP_ALLREDUCE, local, local, f"{tag}.grad_norm", ops.Sum, 1.0, 1.0,
                              process_set=process_set)
    if order_after is None:
        ops.synchronize(handle)
    else:
        order_after(handle)
    return local.sqrt()[0] * scale


def clip_coef(total, max_norm):
    """The factor clip_grad_norm_ scales gradients by (< 1 only when clipping)."""
    return float(max_norm) / (float(total) + 1e-6)


def clip_coef_tensor(total, max_norm):
    """clip_coef on the device, at most 1, as torch.nn.utils.clip_grad_norm_ computes it:
    reading the norm back would make the CPU wait for backward to finish on the GPU."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def found_inf(grads, process_set, device, *, tag):
    """Whether any rank's `grads` hold an inf or NaN (over `process_set`: every rank
    of the optimizer, so that all of them skip the step alike)."""
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
    local = (~finite).float().reshape(1).to(device)
    bad = ops.synchronize(ops._allreduce_async(local, f"{tag}.found_inf", ops.Max, 1.0, 1.0, process_set))
    return bool(bad.item())
