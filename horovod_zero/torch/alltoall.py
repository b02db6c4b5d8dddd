"""hvd.alltoall: each rank sends a slice of its tensor's rows to every rank and
receives one from each, with Horovod's signature and return values."""

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _runtime
from horovod_zero.torch.process_sets import _id, _size, global_process_set


def _splits_list(tensor, splits, process_set):
    """Rows of dim 0 for each rank of the set, as a list of ints (checked by the core)."""
    if splits is None:
        if tensor.dim() == 0:
            return []  # refused by the core with a clear message
        rows, n = tensor.shape[0], _size(process_set)
        if rows % n != 0:
            raise ValueError(
                f"alltoall without splits divides dim 0 evenly, but {rows} rows do not split over {n} ranks; "
                "pass splits= (one count of rows per rank, summing to dim 0).")
        return [rows // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype.is_complex:
            raise ValueError(f"splits must be a 1-D integer tensor or a list of ints; got {splits.dtype} "
                             f"of shape {tuple(splits.shape)}.")
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def _alltoall_async(tensor, splits, name, process_set=None):
    like = splits if isinstance(splits, torch.Tensor) else None
    return _runtime().enqueue_alltoall(tensor, _splits_list(tensor, splits, process_set), name, like,
                                       _id(process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall; synchronize(handle) returns (output, received_splits).

    splits: rows of dim 0 this rank sends to each rank of process_set, in its order (a 1-D
    integer tensor or a list, summing to dim 0); None divides dim 0 evenly. Ranks
    must agree on the dtype and on the shape past dim 0. received_splits: the rows
    received from each rank, with the dtype and device of `splits` when it is a
    tensor, else an int32 CPU tensor."""
    return _alltoall_async(tensor, splits, mpi_ops._name("alltoall", name, process_set), process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = mpi_ops.synchronize(_alltoall_async(tensor, splits, name, process_set))
        ctx.name, ctx.received, ctx.process_set = name, received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        # Each row went to one rank: send the gradients of the received rows back.
        g, _ = mpi_ops.synchronize(_alltoall_async(grad.contiguous(), ctx.received, f"{ctx.name}.grad",
                                                   ctx.process_set))
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends rows of `tensor` to every rank and returns the rows received, rank by
    rank. Returns the output alone when `splits` is None, else (output,
    received_splits), as Horovod does; see alltoall_async. Differentiable when the
    input requires grad."""
    name = mpi_ops._name("alltoall", name, process_set)
    if mpi_ops._differentiable(tensor):
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = mpi_ops.synchronize(_alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)
