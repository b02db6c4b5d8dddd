"""Allreduce of sparse COO tensors, as Horovod does it: every rank's indices and
values are allgathered (ranks may hold different numbers of entries) and the result
is the sparse tensor holding all of them; entries that share an index add up, as a
sparse tensor's duplicates always do. Average divides the values by the number of
ranks. The result is not coalesced (call .coalesce() where that matters)."""

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.process_sets import _size, global_process_set


class SparseAllreduceHandle(mpi_ops.ComposedHandle):
    """hvd.synchronize(handle) (or handle()) waits and returns the sparse result."""

    def __init__(self, like, indices, values, divisor):
        self._like, self._indices, self._values, self._divisor = like, indices, values, divisor
        self._result = None

    def poll(self) -> bool:
        return self._result is not None or mpi_ops.poll([self._indices, self._values])

    def __call__(self):
        if self._result is None:
            indices, values = mpi_ops.synchronize([self._indices, self._values])
            if self._divisor != 1:
                values = values / self._divisor
            # Tensor.new, not torch.sparse_coo_tensor: that one warns on every first use in
            # a process that invariant checks are off, whatever check_invariants says.
            self._result = self._like.new(indices.t(), values, self._like.shape)
        return self._result


def sparse_allreduce_async(tensor, name=None, op=None, process_set=global_process_set):
    """Starts the allreduce of a sparse COO tensor (op Sum or Average, the default)
    over process_set's ranks; returns a handle for hvd.synchronize()."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("sparse_allreduce_async takes a torch.sparse_coo tensor; use allreduce_async for dense "
                        "tensors (or .to_sparse() this one).")
    op = mpi_ops._resolve_op(op, None)
    if op not in (mpi_ops.Sum, mpi_ops.Average):
        raise ValueError("A sparse allreduce adds the ranks' entries: use op=hvd.Sum or hvd.Average.")
    if op == mpi_ops.Average and not tensor.dtype.is_floating_point:
        raise ValueError(f"Average of a {tensor.dtype} sparse tensor is refused, as for dense ones: use op=hvd.Sum "
                         "and divide, or convert the values to a floating-point dtype.")
    name = mpi_ops._name("sparse_allreduce", name, process_set)
    # Allgather concatenates along dim 0: indices go as (entries, sparse dims), one row per entry.
    indices = mpi_ops.allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices",
                                      process_set=process_set)
    values = mpi_ops.allgather_async(tensor._values().contiguous(), name=f"{name}.values", process_set=process_set)
    return SparseAllreduceHandle(tensor, indices, values, _size(process_set) if op == mpi_ops.Average else 1)
