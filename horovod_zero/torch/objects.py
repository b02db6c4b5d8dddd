"""Python objects across ranks: broadcast_object() and allgather_object() (pickled,
sent as bytes). They sit under ZeRO's state code and hybrid sharding, and above the
enqueue layer only."""

import io
import pickle
import threading
import weakref

import torch

from horovod_zero.torch.basics import _runtime, rank
from horovod_zero.torch.enqueue import _broadcast_async, _grouped_allgather_async, synchronize
from horovod_zero.torch.process_sets import _id, global_process_set


class _ObjectNames:
    """Numbers that every rank of a process set agrees on without any message: the
    n-th call of a job (one runtime, one init()) for one kind of thing on a set gets n
    on every rank of the set (one count per set and kind: only its ranks call it).
    Unnamed broadcast_object() calls are named broadcast_object.n by them, and ZeRO
    optimizers number their collectives' names (agreed_number()). The counts live as
    long as their runtime, so a re-init starts again at 0 on every rank alike. Threads
    take numbers under a lock: two of them must never share a number or skip one, or
    the ranks' names drift apart and the job stalls."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = weakref.WeakKeyDictionary()  # runtime -> {(process set id, kind): next number}

    def number(self, runtime, set_id=0, kind="broadcast_object"):
        with self._lock:
            counts = self._next.setdefault(runtime, {})
            n = counts.get((set_id, kind), 0)
            counts[(set_id, kind)] = n + 1
        return n

    def take(self, runtime, set_id=0):
        return f"broadcast_object.{self.number(runtime, set_id)}"

    def reserve(self, runtime, set_id, kind, n):
        """Number n is taken: the next number() for `kind` is above it."""
        with self._lock:
            counts = self._next.setdefault(runtime, {})
            counts[(set_id, kind)] = max(counts.get((set_id, kind), 0), n + 1)


_object_names = _ObjectNames()


def agreed_number(kind, process_set=global_process_set):
    """How many times this job's ranks of `process_set` called this before for `kind`:
    the same number on each of them when they call it in the same order (as when each
    builds the same objects in the same order)."""
    return _object_names.number(_runtime(), _id(process_set), kind)


def reserve_number(kind, process_set, n):
    """Marks number n of `kind` on `process_set` as taken in this job (an object made in
    an earlier job that keeps its number): agreed_number() continues above it."""
    _object_names.reserve(_runtime(), _id(process_set), kind, n)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns root_rank's `obj` on every rank of process_set (pickled, sent as bytes).

    Unnamed calls are paired across ranks by the order in which each rank makes them.
    Threads that call it at the same time may take their turns in another order on
    each rank, so pass name= to pair each thread's calls with its peers'."""
    if name is None:
        name = _object_names.take(_runtime(), _id(process_set))
    if rank() == root_rank:
        buf = io.BytesIO()
        pickle.dump(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    length = synchronize(_broadcast_async(length, root_rank, f"{name}.len", process_set))
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    if payload.numel():
        payload = synchronize(_broadcast_async(payload, root_rank, f"{name}.data", process_set))
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's `obj` (pickled), in rank order (of
    process_set: ps.rank()). Every rank of the set must call it; the objects may
    differ in type and size."""
    name = name or "allgather_object"
    data = pickle.dumps(obj)
    # One grouped op: each rank's byte count (to split the bytes apart) and its bytes.
    lengths, gathered = synchronize(_grouped_allgather_async(
        [torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)],
        [f"{name}.len", f"{name}.data"], None, process_set))
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(gathered[start:start + n].numpy().tobytes()))
        start += n
    return out
