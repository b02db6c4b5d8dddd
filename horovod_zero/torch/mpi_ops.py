"""Collectives with Horovod's names and semantics: async ops return handles,
synchronize() returns the output or raises. Every op takes process_set= (default
hvd.global_process_set, every rank): see process_sets.py."""

import torch

from horovod_zero.torch import autograd
from horovod_zero.torch.compression import Compression
from horovod_zero.torch.enqueue import (  # noqa: F401 - re-exported: hvd.Sum, hvd.synchronize, ...
    Average, ComposedHandle, HorovodInternalError, Max, Min, Product, Sum, _allgather_async, _allreduce_async,
    _auto_name, _broadcast_async, _core, _enqueue, _enqueue_one, _grouped_allgather_async, _grouped_allreduce_async,
    _grouped_reducescatter_async, _name, _names, _reducescatter_async, _scatter_output, _wait_stream, poll,
    synchronize)
from horovod_zero.torch.process_sets import global_process_set

# Horovod's name, so that scripts that mention it import; not an op of our core,
# and every op that is given it refuses it (_resolve_op).
Adasum = 100

_ADASUM_REFUSED = (
    "hvd.Adasum is not supported by horovod_zero. Use op=hvd.Average (Horovod's default: "
    "gradients averaged over ranks; scale the learning rate with hvd.size() as Horovod's docs do "
    "for Average) or op=hvd.Sum.")


def _resolve_op(op, average):
    if average is not None:
        if op is not None:
            raise ValueError("Pass either op= or the deprecated average=, not both.")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(_ADASUM_REFUSED)
    if op not in (Sum, Average, Min, Max, Product):
        raise ValueError(f"op={op!r} is not one of hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product.")
    return op


def _check_tensors(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list of tensors.")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} takes tensors; got {type(t).__name__}.")
    # The core refuses a group over two devices (Runtime::CheckDevices).
    return list(tensors)


def _reducing(function, run, tensors, names, compression, op, prescale_factor, postscale_factor, process_set):
    """A synchronous allreduce or reducescatter: compresses, reduces (through the
    autograd Function of that name when an input requires grad, else with
    run(tensors, names, op, prescale, postscale, process_set)), decompresses."""
    pairs = [compression.compress(t) for t in tensors]
    wire = [t for t, _ in pairs]
    if _differentiable_any(wire):
        outs = getattr(autograd, function).apply(names, op, prescale_factor, postscale_factor, process_set, *wire)
    else:
        outs = run(wire, names, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(outs, pairs)]


def _one(start):
    """run() for _reducing from a one-tensor async op."""
    return lambda tensors, names, *args: [synchronize(start(tensors[0], names[0], *args))]


def _waited(start):
    """run() for _reducing from a grouped async op."""
    return lambda *args: synchronize(start(*args))


# --- allreduce ---------------------------------------------------------------

def _differentiable(tensor):
    return tensor.requires_grad and torch.is_grad_enabled()


def _differentiable_any(tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Average divides by the number of ranks in process_set."""
    op = _resolve_op(op, average)
    return _allreduce_async(tensor, _name("allreduce", name, process_set), op, prescale_factor, postscale_factor,
                            process_set)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Differentiable when the input requires grad (gradients: see autograd.py).
    `compression` (hvd.Compression.fp16) sets what crosses the wire; the result has
    the input's dtype."""
    op, name = _resolve_op(op, average), _name("allreduce", name, process_set)
    if compression is Compression.none and not _differentiable(tensor):
        # no lists: ~2 us
        return synchronize(_allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set))
    return _reducing("Allreduce", _one(_allreduce_async), [tensor], [name], compression, op, prescale_factor,
                     postscale_factor, process_set)[0]


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    op = _resolve_op(op, average)
    return _enqueue_one(_core.OP_ALLREDUCE, tensor, tensor, _name("allreduce", name, process_set), op,
                        prescale_factor, postscale_factor, process_set=process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    tensors = _check_tensors(tensors, "grouped_allreduce")
    op = _resolve_op(op, average)
    return _grouped_allreduce_async(tensors, _names("grouped_allreduce", name, len(tensors), process_set), op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Differentiable when an input requires grad, as allreduce."""
    tensors = _check_tensors(tensors, "grouped_allreduce")
    return _reducing("Allreduce", _waited(_grouped_allreduce_async), tensors,
                     _names("grouped_allreduce", name, len(tensors), process_set), compression,
                     _resolve_op(op, average), prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    tensors = _check_tensors(tensors, "grouped_allreduce_")
    op = _resolve_op(op, average)
    return _enqueue(_core.OP_ALLREDUCE, tensors, list(tensors),
                    _names("grouped_allreduce", name, len(tensors), process_set), op, prescale_factor,
                    postscale_factor, process_set=process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# --- allgather ---------------------------------------------------------------


def allgather_async(tensor, name=None, output_dtype=None, process_set=global_process_set):
    """Concatenates every rank's tensor along dim 0, in rank order (of process_set:
    ps.rank()). Dim 0 may differ between ranks. output_dtype casts while copying into
    the fusion buffer, so the narrower dtype is what crosses the wire."""
    return _allgather_async(tensor, _name("allgather", name, process_set), output_dtype, process_set)


def allgather(tensor, name=None, output_dtype=None, process_set=global_process_set):
    """Differentiable when the input requires grad."""
    name = _name("allgather", name, process_set)
    if _differentiable(tensor):
        return autograd.Allgather.apply([name], output_dtype, process_set, tensor)[0]
    return synchronize(_allgather_async(tensor, name, output_dtype, process_set))


def grouped_allgather_async(tensors, name=None, output_dtype=None, process_set=global_process_set):
    tensors = _check_tensors(tensors, "grouped_allgather")
    return _grouped_allgather_async(tensors, _names("grouped_allgather", name, len(tensors), process_set),
                                    output_dtype, process_set)


def grouped_allgather(tensors, name=None, output_dtype=None, process_set=global_process_set):
    """Differentiable when an input requires grad, as allgather."""
    tensors = _check_tensors(tensors, "grouped_allgather")
    names = _names("grouped_allgather", name, len(tensors), process_set)
    if _differentiable_any(tensors):
        return list(autograd.Allgather.apply(names, output_dtype, process_set, *tensors))
    return synchronize(_grouped_allgather_async(tensors, names, output_dtype, process_set))


# --- reducescatter -------------------------------------------------------------


def reducescatter_async(tensor, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=global_process_set):
    """Reduces over ranks, then splits along dim 0: the rank at place r of the set
    (ps.rank()) keeps slice r; the first dim0 % size places get one extra row."""
    op = _resolve_op(op, None)
    return _reducescatter_async(tensor, _name("reducescatter", name, process_set), op, prescale_factor,
                                postscale_factor, process_set)


def reducescatter(tensor, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                  postscale_factor=1.0, process_set=global_process_set):
    """Differentiable when the input requires grad (gradients: see autograd.py)."""
    return _reducing("Reducescatter", _one(_reducescatter_async), [tensor],
                     [_name("reducescatter", name, process_set)], compression, _resolve_op(op, None),
                     prescale_factor, postscale_factor, process_set)[0]


def grouped_reducescatter_async(tensors, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                                process_set=global_process_set):
    tensors = _check_tensors(tensors, "grouped_reducescatter")
    op = _resolve_op(op, None)
    return _grouped_reducescatter_async(tensors, _names("grouped_reducescatter", name, len(tensors), process_set),
                                        op, prescale_factor, postscale_factor, process_set)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                          postscale_factor=1.0, process_set=global_process_set):
    """Differentiable when an input requires grad, as reducescatter."""
    tensors = _check_tensors(tensors, "grouped_reducescatter")
    return _reducing("Reducescatter", _waited(_grouped_reducescatter_async), tensors,
                     _names("grouped_reducescatter", name, len(tensors), process_set), compression,
                     _resolve_op(op, None), prescale_factor, postscale_factor, process_set)


# --- broadcast ---------------------------------------------------------------


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank is the root's rank in the job (hvd.rank()), one of process_set's ranks."""
    return _broadcast_async(tensor, root_rank, _name("broadcast", name, process_set), process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Differentiable when the input requires grad: the root's input gets the
    average (Horovod's) or the sum (exact gradients) of every rank's gradient, the
    others' get zeros (see autograd.py)."""
    name = _name("broadcast", name, process_set)
    if _differentiable(tensor):
        return autograd.Broadcast.apply(name, root_rank, process_set, tensor)
    return synchronize(_broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _enqueue_one(_core.OP_BROADCAST, tensor, tensor, _name("broadcast", name, process_set), root=root_rank,
                        process_set=process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def barrier(process_set=global_process_set):
    """Returns once every rank of process_set has called barrier()."""
    allreduce(torch.zeros(1), name=_auto_name("barrier", process_set), op=Sum, process_set=process_set)
