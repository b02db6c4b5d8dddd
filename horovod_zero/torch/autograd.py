"""Autograd for the synchronous collectives, as in Horovod: hvd.allreduce,
allgather, reducescatter and broadcast are differentiable when their input
requires grad. Each backward is the exact gradient of the sum of every rank's loss,
computed with one collective (named after the forward op)."""

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import rank, size


def _reducing(ctx, what, name, op, prescale, postscale):
    """Checks a reducing op is differentiable and keeps what its backward needs."""
    if op not in (mpi_ops.Sum, mpi_ops.Average):
        raise ValueError(f"Only Sum and Average {what}s are differentiable; detach() the input for Min/Max.")
    ctx.name = name
    ctx.scale = prescale * postscale / (size() if op == mpi_ops.Average else 1)


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale):
        _reducing(ctx, "allreduce", name, op, prescale, postscale)
        return mpi_ops.synchronize(mpi_ops._allreduce_async(tensor, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        # d/dx_r of sum_k L_k(scale * sum_j x_j) = scale * sum_k dL_k/dy.
        g = mpi_ops.allreduce(grad.contiguous(), name=f"{ctx.name}.grad", op=mpi_ops.Sum, postscale_factor=ctx.scale)
        return g, None, None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, output_dtype):
        ctx.name, ctx.dtype, ctx.rows = name, tensor.dtype, tensor.shape[0]
        return mpi_ops.synchronize(mpi_ops._allgather_async(tensor, name, output_dtype))

    @staticmethod
    def backward(ctx, grad):
        # This rank's rows of the sum over ranks of the output's gradient.
        rows = mpi_ops.allgather(torch.tensor([ctx.rows]), name=f"{ctx.name}.grad.rows")
        start = int(rows[:rank()].sum())
        g = mpi_ops.allreduce(grad.contiguous(), name=f"{ctx.name}.grad", op=mpi_ops.Sum)
        return g[start:start + ctx.rows].to(ctx.dtype), None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale):
        _reducing(ctx, "reducescatter", name, op, prescale, postscale)
        return mpi_ops.synchronize(mpi_ops._reducescatter_async(tensor, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        # Row block r of every input feeds rank r's output: gather the blocks back.
        g = mpi_ops.allgather(grad.contiguous(), name=f"{ctx.name}.grad")
        return g * ctx.scale, None, None, None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.name, ctx.root = name, root_rank
        return mpi_ops.synchronize(mpi_ops._broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        # Every rank's output is the root's input: the root gets the sum, the others nothing.
        g = mpi_ops.allreduce(grad.contiguous(), name=f"{ctx.name}.grad", op=mpi_ops.Sum)
        return (g if rank() == ctx.root else torch.zeros_like(g)), None, None
