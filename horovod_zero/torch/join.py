"""hvd.join(): for ranks with different numbers of batches, as in Horovod."""

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _runtime


def join(device=-1) -> int:
    """Says this rank has run out of data, and waits until every rank has called join().

    Meanwhile this rank takes part in the allreduces the other ranks still submit,
    with zeros: Sum adds nothing, and Average still divides by hvd.size(), as in
    Horovod (Min, Max and Product see the zeros too). Any other collective that a
    joined rank did not submit fails on the ranks that did. Returns the rank that
    joined last, the same on every rank.

    A rank that never joins (nor shuts down) is reported like a stalled tensor:
    warned about after HOROVOD_STALL_CHECK_TIME_SECONDS, and join() fails after
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS when that is set.

    device: the CUDA device for the zeros of CUDA allreduces. -1 (the default): a
    GPU this rank already reduces on with the same ranks, else one of its own that
    the others on this host do not use there (hvd.device() for one GPU per rank)."""
    if device is None or device < 0:
        device = -1
    return int(mpi_ops.synchronize(_runtime().join(int(device))).item())
