"""The layer under the public collectives: op names, one (grouped) enqueue into the
runtime, and handles (synchronize, poll, stream-ordered waits). The public API
(mpi_ops.py), its autograd Functions (autograd.py), process-set registration
(job.py), the object collectives (objects.py) and ZeRO enqueue through here, so none
of them imports another to reach the runtime."""

import functools
import itertools
import threading
from collections import defaultdict

import torch

from horovod_zero.torch.basics import _core, _runtime
from horovod_zero.torch.process_sets import _id, _rank, _size

HorovodInternalError = _core.HorovodInternalError

Sum = _core.SUM
Average = _core.AVERAGE
Min = _core.MIN
Max = _core.MAX
Product = _core.PRODUCT

_counters = defaultdict(itertools.count)
_counter_lock = threading.Lock()


def _auto_name(kind, process_set=None):
    # Every rank of a set submits its unnamed ops on it in the same order, so a
    # count per set (names are the set's own) agrees across its ranks.
    set_id = _id(process_set)
    with _counter_lock:
        return f"{kind}.noname.{next(_counters[kind, set_id])}"


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


def _wait_stream(handle, device, let_go=False):
    """Orders the current CUDA stream of `device` after the op (or a list of them), on the GPU, without waiting
    for it to run (a CPU op: waits until it is done). The handle stays valid:
    synchronize() still releases it and reports a failure that comes later.
    `let_go`: the handle no longer holds the op's tensors (synchronize() then returns
    None), so they are freed when the caller drops its own references; the caller's
    later work on this stream is ordered after the op."""
    index = _device_index(device)
    if isinstance(handle, list):  # many for one call: one wait per fused collective
        _runtime().wait_stream_all(handle, index, let_go)
    else:
        _runtime().wait_stream(handle, index, let_go)


def _try_wait_stream(handle, device):
    """_wait_stream() without waiting: True (and the current stream ordered after the op)
    if the op is queued on the GPU or done already; False, with nothing changed, if not."""
    return _runtime().try_wait_stream(handle, _device_index(device))


def _try_let_go(handles, device, stream):
    """For each CUDA op already queued on the GPU: `stream` (a side stream, never the
    compute stream) waits for it, and its handle lets go of its tensors; see [Note: letting
    go once queued] in python/adapter.cc. Per handle, whether it is settled (let go, failed,
    or released already; synchronize() reports a failure)."""
    return _runtime().try_let_go_all(handles, _device_index(device), stream.cuda_stream)


def _device_index(device):
    """The CUDA device's index for the runtime's stream calls; -1 for the host."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def poll(handle) -> bool:
    """True when the op behind the handle (every op, for a nested list) has finished."""
    rt = _runtime()
    if isinstance(handle, (list, tuple)):
        return all(poll(h) for h in handle)
    if isinstance(handle, ComposedHandle):
        return handle.poll()
    return rt.poll(handle)


def _allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue_one(_core.OP_ALLREDUCE, tensor, None, name, op, prescale_factor, postscale_factor,
                        process_set=process_set)


def _grouped_allreduce_async(tensors, names, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue(_core.OP_ALLREDUCE, tensors, [None] * len(tensors), names, op, prescale_factor, postscale_factor,
                    process_set=process_set)


def _allgather_async(tensor, name, output_dtype, process_set=None):
    return _enqueue_one(_core.OP_ALLGATHER, tensor, None, name, output_dtype=output_dtype, process_set=process_set)


def _grouped_allgather_async(tensors, names, output_dtype, process_set=None):
    return _enqueue(_core.OP_ALLGATHER, tensors, [None] * len(tensors), names, output_dtype=output_dtype,
                    process_set=process_set)


def _scatter_output(tensor, process_set=None):
    if tensor.dim() == 0:
        return None  # refused with a clear message by the core's validation
    n, r = _size(process_set), _rank(process_set)
    rows = tensor.shape[0] // n + (1 if r < tensor.shape[0] % n else 0)
    return tensor.new_empty((rows,) + tuple(tensor.shape[1:]))


def _reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue_one(_core.OP_REDUCESCATTER, tensor, _scatter_output(tensor, process_set), name, op,
                        prescale_factor, postscale_factor, process_set=process_set)


def _grouped_reducescatter_async(tensors, names, op, prescale_factor, postscale_factor, process_set=None):
    return _enqueue(_core.OP_REDUCESCATTER, tensors, [_scatter_output(t, process_set) for t in tensors], names, op,
                    prescale_factor, postscale_factor, process_set=process_set)


def _broadcast_async(tensor, root_rank, name, process_set=None):
    return _enqueue_one(_core.OP_BROADCAST, tensor, None, name, root=root_rank, process_set=process_set)
