"""hvd.SyncBatchNorm: batch normalization whose batch statistics are those of every
rank's batch together, as Horovod's (and torch.nn.SyncBatchNorm, over Horovod's
collectives instead of torch.distributed). In eval mode, or alone in its process set,
it is plain batch normalization.

Forward: each rank's per-channel count, mean and biased variance are allgathered and
combined (the parallel form of Welford's update, stable where E[x^2] - E[x]^2 is not);
the running statistics take the unbiased global variance. Backward: the per-channel sums
of dy and dy * x_hat are allreduced, so every rank's input gradient is the full batch's.
The weight and bias gradients stay local (sums over this rank's batch), as Horovod
leaves them: the optimizer's allreduce averages them like every other gradient."""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.process_sets import global_process_set


class SyncBatchNorm(_BatchNorm):
    """Arguments as torch.nn.BatchNorm*d (any input of shape (N, C, ...)), plus the
    process set whose ranks share statistics."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}D input.")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum=None: the cumulative average, as _BatchNorm computes it
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                    self.eps, factor, self.process_set)


def _per_channel(t):
    """(N, C, ...) as (C, elements per channel), in fp32 at least."""
    t = t.transpose(0, 1).reshape(t.shape[1], -1)
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _shape(v, like):
    """A per-channel vector broadcast against an (N, C, ...) tensor."""
    return v.reshape((1, -1) + (1,) * (like.dim() - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, process_set):
        x = _per_channel(input)
        count = torch.full((x.shape[0],), float(x.shape[1]), dtype=x.dtype, device=x.device)
        mean = x.mean(dim=1)
        var = x.var(dim=1, correction=0)
        # One row per rank: count, mean, biased variance of each channel.
        rows = mpi_ops.allgather(torch.stack([count, mean, var]).unsqueeze(0), process_set=process_set)
        counts, means, variances = rows[:, 0], rows[:, 1], rows[:, 2]
        total = counts.sum(dim=0)
        if (total <= 1).any():
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over all ranks in training, got "
                             f"{int(total.min())} (input of shape {list(input.shape)} on this rank).")
        g_mean = (counts * means).sum(dim=0) / total
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(dim=0) / total
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((g_var * total / (total - 1)).to(running_var.dtype), alpha=factor)
        x_hat = (input - _shape(g_mean, input)) * _shape(invstd, input)
        out = x_hat
        if weight is not None:
            out = out * _shape(weight, input) + _shape(bias, input)
        ctx.save_for_backward(input, weight, g_mean, invstd, total)
        ctx.process_set = process_set
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, g_mean, invstd, total = ctx.saved_tensors
        dy = _per_channel(grad_output)
        x_hat = (_per_channel(input) - g_mean[:, None]) * invstd[:, None]
        sum_dy = dy.sum(dim=1)
        sum_dy_xhat = (dy * x_hat).sum(dim=1)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight, grad_bias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = mpi_ops.allreduce(torch.stack([sum_dy, sum_dy_xhat]), op=mpi_ops.Sum, process_set=ctx.process_set)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            # dL/dx for y = x_hat * w + b with the global mean and variance
            grad = (dy - (both[0][:, None] + x_hat * both[1][:, None]) / total[:, None]) * scale[:, None]
            grad_input = grad.reshape((input.shape[1], input.shape[0]) + tuple(input.shape[2:])).transpose(0, 1)
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
