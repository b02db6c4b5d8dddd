"""Helpers built on the collectives: parameters and Python objects from a root rank."""

import io
import pickle
import threading
import weakref

import torch

from horovod_zero.torch.mpi_ops import broadcast_, broadcast_async_, synchronize
from horovod_zero.torch.basics import _runtime, rank


def broadcast_parameters(params, root_rank=0):
    """Overwrites every rank's parameters with root_rank's. `params` is a
    state_dict or an iterable of (name, tensor) such as model.named_parameters()."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            raise ValueError("broadcast_parameters takes a state_dict or named_parameters(), not bare tensors.")
    handles, copies = [], []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        target = t if t.is_contiguous() else t.contiguous()
        handles.append(broadcast_async_(target, root_rank, name=f"broadcast_parameters.{name}"))
        if target is not t:
            copies.append((t, target))
    for h in handles:
        synchronize(h)
    with torch.no_grad():
        for t, target in copies:
            t.copy_(target)


class _ObjectNames:
    """Names for unnamed broadcast_object() calls: the n-th call of a job (one runtime,
    one init()) is broadcast_object.n on every rank, so the names agree without any
    message. The count lives as long as its runtime, so a re-init starts again at 0
    on every rank alike. Threads take numbers under a lock: two of them must never
    share a number or skip one, or the ranks' names drift apart and the job stalls."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = weakref.WeakKeyDictionary()  # runtime -> next number

    def take(self, runtime):
        with self._lock:
            n = self._next.get(runtime, 0)
            self._next[runtime] = n + 1
        return f"broadcast_object.{n}"


_object_names = _ObjectNames()


def broadcast_object(obj, root_rank=0, name=None):
    """Returns root_rank's `obj` on every rank (pickled, sent as bytes).

    Unnamed calls are paired across ranks by the order in which each rank makes them.
    Threads that call it at the same time may take their turns in another order on
    each rank, so pass name= to pair each thread's calls with its peers'."""
    if name is None:
        name = _object_names.take(_runtime())
    if rank() == root_rank:
        buf = io.BytesIO()
        pickle.dump(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{name}.len")
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    if payload.numel():
        broadcast_(payload, root_rank, name=f"{name}.data")
    return pickle.loads(payload.numpy().tobytes())
