"""Collectives with Horovod's names and semantics: async ops return handles,
synchronize() returns the output or raises. Every op takes process_set= (default
hvd.global_process_set, every rank): see process_sets.py."""

import functools
import itertools
import threading
from collections import defaultdict

import torch

from horovod_zero.torch.basics import _core, _runtime
from horovod_zero.torch.compression import Compression
from horovod_zero.torch.process_sets import _id, _rank, _size, global_process_set

HorovodInternalError = _core.HorovodInternalError

Sum = _core.SUM
Average = _core.AVERAGE
Min = _core.MIN
Max = _core.MAX
Product = _core.PRODUCT
# Horovod's name, so that scripts that mention it import; not an op of our core,
# and every op that is given it refuses it (_resolve_op).
Adasum = 100

_ADASUM_REFUSED = (
    "hvd.Adasum is not supported by horovod_zero. Use op=hvd.Average (Horovod's default: "
    "gradients averaged over ranks; scale the learning rate with hvd.size() as Horovod's docs do "
    "for Average) or op=hvd.Sum.")

_counters = defaultdict(itertools.count)
_counter_lock = threading.Lock()


def _auto_name(kind, process_set=None):
    # Every rank of a set submits its unnamed ops on it in the same order, so a
    # count per set (names are the set's own) agrees across its ranks.
    set_id = _id(process_set)
    with _counter_lock:
        return f"{kind}.noname.{next(_counters[kind, set_id])}"


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


def _name(kind, name, process_set=None):
    if name is None:
        return _auto_name(kind, process_set)
    return name if isinstance(name, str) else _names(kind, name, 1)[0]


def _names(kind, name, n, process_set=None):
    if name is None:
        return [_auto_name(kind, process_set) for _ in range(n)]
    if isinstance(name, str):
        return [name] if n == 1 else [f"{name}.{i}" for i in range(n)]
    names = list(name)
    if len(names) != n:
        raise ValueError(f"Got {len(names)} names for {n} tensors; pass one name per tensor.")
    return names


def _check_tensors(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list of tensors.")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} takes tensors; got {type(t).__name__}.")
    return list(tensors)


@functools.lru_cache(maxsize=256)
def _op_args(op, reduce_op, prescale, postscale, root, output_dtype, set_id):
    # Built once per distinct setting: constructing it costs as much as the rest of an enqueue.
    return _core.OpArgs(op, reduce_op, float(prescale), float(postscale), int(root), output_dtype, set_id)


def _enqueue(op, inputs, outputs, names, reduce_op=Sum, prescale=1.0, postscale=1.0, root=0, output_dtype=None,
             process_set=None):
    """One (grouped) op; `process_set`: an hvd.ProcessSet (None: the global one)."""
    args = _op_args(op, reduce_op, prescale, postscale, root, output_dtype, _id(process_set))
    return _runtime().enqueue(args, inputs, outputs, names)


def _enqueue_one(op, tensor, output, name, reduce_op=Sum, prescale=1.0, postscale=1.0, root=0, output_dtype=None,
                 process_set=None):
    # One tensor without building lists: this is the path of every async op, where
    # the lists' allocations (and the garbage collections they trigger) showed up.
    args = _op_args(op, reduce_op, prescale, postscale, root, output_dtype, _id(process_set))
    return _runtime().enqueue_one(args, tensor, output, name)


class ComposedHandle:
    """A handle whose result Python builds from other ops' outputs (the sparse
    allreduce's). synchronize() calls it; as in Horovod, calling it directly works too."""

    def __call__(self):
        raise NotImplementedError

    def poll(self) -> bool:
        raise NotImplementedError


def synchronize(handle):
    """Waits for a handle, or a (nested) list of them such as grouped ops return, and
    returns the output(s) in the same shape; raises HorovodInternalError if an op failed."""
    rt = _runtime()
    if isinstance(handle, (list, tuple)):
        if all(isinstance(h, int) for h in handle):
            return rt.wait_all(list(handle))  # one release of the GIL for all of them
        return [synchronize(h) for h in handle]
    if isinstance(handle, ComposedHandle):
        return handle()
    return rt.wait(handle)


def _wait_stream(handle, device):
    """Orders the current CUDA stream of `device` after the op, on the GPU, without waiting
    for it to run (a CPU op: waits until it is done). The handle stays valid:
    synchronize() still releases it and reports a failure that comes later."""
    index = -1
    if device.type == "cuda":
        import torch
        index = device.index if device.index is not None else torch.cuda.current_device()
    _runtime().wait_stream(handle, index)


def poll(handle) -> bool:
    """True when the op behind the handle (every op, for a nested list) has finished."""
    rt = _runtime()
    if isinstance(handle, (list, tuple)):
        return all(poll(h) for h in handle)
    if isinstance(handle, ComposedHandle):
        return handle.poll()
    return rt.poll(handle)


def _reducing(function, run, tensors, names, compression, op, prescale_factor, postscale_factor, process_set):
    """A synchronous allreduce or reducescatter: compresses, reduces (through the
    autograd Function of that name when an input requires grad, else with
    run(tensors, names, op, prescale, postscale, process_set)), decompresses."""
    pairs = [compression.compress(t) for t in tensors]
    wire = [t for t, _ in pairs]
    if _differentiable_any(wire):
        from horovod_zero.torch import autograd
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


def _allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue_one(_core.OP_ALLREDUCE, tensor, None, name, op, prescale_factor, postscale_factor,
                        process_set=process_set)


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


def _grouped_allreduce_async(tensors, names, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue(_core.OP_ALLREDUCE, tensors, [None] * len(tensors), names, op, prescale_factor, postscale_factor,
                    process_set=process_set)


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

def _allgather_async(tensor, name, output_dtype, process_set=None):
    return _enqueue_one(_core.OP_ALLGATHER, tensor, None, name, output_dtype=output_dtype, process_set=process_set)


def allgather_async(tensor, name=None, output_dtype=None, process_set=global_process_set):
    """Concatenates every rank's tensor along dim 0, in rank order (of process_set:
    ps.rank()). Dim 0 may differ between ranks. output_dtype casts while copying into
    the fusion buffer, so the narrower dtype is what crosses the wire."""
    return _allgather_async(tensor, _name("allgather", name, process_set), output_dtype, process_set)


def allgather(tensor, name=None, output_dtype=None, process_set=global_process_set):
    """Differentiable when the input requires grad."""
    name = _name("allgather", name, process_set)
    if _differentiable(tensor):
        from horovod_zero.torch.autograd import Allgather
        return Allgather.apply([name], output_dtype, process_set, tensor)[0]
    return synchronize(_allgather_async(tensor, name, output_dtype, process_set))


def _grouped_allgather_async(tensors, names, output_dtype, process_set=None):
    return _enqueue(_core.OP_ALLGATHER, tensors, [None] * len(tensors), names, output_dtype=output_dtype,
                    process_set=process_set)


def grouped_allgather_async(tensors, name=None, output_dtype=None, process_set=global_process_set):
    tensors = _check_tensors(tensors, "grouped_allgather")
    return _grouped_allgather_async(tensors, _names("grouped_allgather", name, len(tensors), process_set),
                                    output_dtype, process_set)


def grouped_allgather(tensors, name=None, output_dtype=None, process_set=global_process_set):
    """Differentiable when an input requires grad, as allgather."""
    tensors = _check_tensors(tensors, "grouped_allgather")
    names = _names("grouped_allgather", name, len(tensors), process_set)
    if _differentiable_any(tensors):
        from horovod_zero.torch.autograd import Allgather
        return list(Allgather.apply(names, output_dtype, process_set, *tensors))
    return synchronize(_grouped_allgather_async(tensors, names, output_dtype, process_set))


# --- reducescatter -------------------------------------------------------------

def _scatter_output(tensor, process_set=None):
    if tensor.dim() == 0:
        return None  # refused with a clear message by the core's validation
    n, r = _size(process_set), _rank(process_set)
    rows = tensor.shape[0] // n + (1 if r < tensor.shape[0] % n else 0)
    return tensor.new_empty((rows,) + tuple(tensor.shape[1:]))


def _reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue_one(_core.OP_REDUCESCATTER, tensor, _scatter_output(tensor, process_set), name, op,
                        prescale_factor, postscale_factor, process_set=process_set)


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


def _grouped_reducescatter_async(tensors, names, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue(_core.OP_REDUCESCATTER, tensors, [_scatter_output(t, process_set) for t in tensors], names, op,
                    prescale_factor, postscale_factor, process_set=process_set)


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

def _broadcast_async(tensor, root_rank, name, process_set=None):
    return _enqueue_one(_core.OP_BROADCAST, tensor, None, name, root=root_rank, process_set=process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank is the root's rank in the job (hvd.rank()), one of process_set's ranks."""
    return _broadcast_async(tensor, root_rank, _name("broadcast", name, process_set), process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Differentiable when the input requires grad: the root's input gets the
    average (Horovod's) or the sum (exact gradients) of every rank's gradient, the
    others' get zeros (see autograd.py)."""
    name = _name("broadcast", name, process_set)
    if _differentiable(tensor):
        from horovod_zero.torch.autograd import Broadcast
        return Broadcast.apply(name, root_rank, process_set, tensor)
    return synchronize(_broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _enqueue_one(_core.OP_BROADCAST, tensor, tensor, _name("broadcast", name, process_set), root=root_rank,
                        process_set=process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def barrier(process_set=global_process_set):
    """Returns once every rank of process_set has called barrier()."""
    allreduce(torch.zeros(1), name=_auto_name("barrier", process_set), op=Sum, process_set=process_set)
