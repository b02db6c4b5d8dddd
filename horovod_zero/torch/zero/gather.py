"""Parameter gathering: the fp32 master shards allgathered into the parameters'
buffers with output_dtype=param_dtype, so the downcast happens in the runtime's
copy-in and only param_dtype crosses the wire (HOROVOD_ZERO_DOWNCAST=0 gathers
fp32 and casts afterwards, for comparison). Each call is one grouped enqueue per
dtype, which the runtime fuses into one collective; the handles stay here until
someone waits for them."""

import contextlib
import weakref

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _core
from horovod_zero.torch.zero.units import assign


class ParamGatherer:
    def __init__(self, storage, downcast):
        self._storage = storage
        self._downcast = downcast
        self.in_flight = {}  # shard index -> allgather handle
        # Offload: (index, buffer) -> the param_dtype shard on the device to gather from
        # (offload/host.py); None gathers the master shards. source_stream: the CUDA stream
        # the sources are copied on and the gathers enqueued from (None: the current one).
        self.source = None
        self.source_stream = None
        self.before = None  # called with a gather's indices first (offload: waits for their host step)
        self._after = {}  # shard index -> (buffer, fp32 copy) to cast once gathered (downcast off)
        self._ordered = {}  # shard index -> handle the stream waits for, not yet synchronized
        # A dropped optimizer lets go of its handles, which hold its buffers in the runtime.
        weakref.finalize(self, _synchronize_all, self.in_flight, self._ordered).atexit = False

    def gather(self, indices):
        """Enqueues the gathers of the master shards at `indices` into their buffers
        (at stage 3 allocating them first)."""
        st = self._storage
        if self.before is not None:
            self.before(indices)
        self.wait(indices)  # one gather of a parameter in flight at a time: the names stay unique
        self.release(indices)
        by_dtype = {}
        for i in indices:
            out = st.unshard(i) if st.sharded_params else st.stores[i]
            by_dtype.setdefault(out.dtype, []).append((i, out))
        stream = self.source_stream
        if stream is not None and by_dtype:
            # The buffers come from the compute stream's pool and may be what it still reads.
            stream.wait_stream(torch.cuda.current_stream(st.param_device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._enqueue(by_dtype)

    def _enqueue(self, by_dtype):
        st = self._storage
        for dtype, items in by_dtype.items():
            if self.source is not None:
                ins = [self.source(i, o) for i, o in items]
            else:
                ins = [st.master_params[i].detach().to(st.param_device) for i, _ in items]
            if self._downcast or self.source is not None:
                outs, out_dtype = [o for _, o in items], dtype
            else:
                outs = [torch.empty(o.numel(), dtype=torch.float32, device=o.device) for _, o in items]
                self._after.update({i: (o, full) for (i, o), full in zip(items, outs)})
                out_dtype = None
            names = [f"zero.param.{i}" for i, _ in items]
            handles = mpi_ops._enqueue(_core.OP_ALLGATHER, ins, outs, names, output_dtype=out_dtype,
                                       process_set=st.shard_set)
            self.in_flight.update({i: h for (i, _), h in zip(items, handles)})

    def wait(self, indices=None, stream_ordered=False):
        """Waits for the gathers of `indices` (all when None) that are in flight.
        `stream_ordered`: only orders the current stream after them (CUDA), so that the CPU
        need not wait for them to run; release() synchronizes them later."""
        for i in list(self.in_flight) if indices is None else indices:
            h = self.in_flight.pop(i, None)
            if h is None:
                continue
            if stream_ordered and i not in self._after:
                self._ordered[i] = h  # first: if the wait is interrupted, release() still has it
                mpi_ops._wait_stream(h, self._storage.param_device)
                continue
            mpi_ops.synchronize(h)
            if i in self._after:
                out, full = self._after.pop(i)
                out.copy_(full)

    def release_finished(self):
        """Releases the stream-ordered gathers that have run, without waiting for others."""
        for i, h in list(self._ordered.items()):
            if mpi_ops.poll(h) and self._ordered.pop(i, None) is h:
                mpi_ops.synchronize(h)

    def release(self, indices=None):
        """Synchronizes the gathers that wait() only ordered the stream after: releases
        their handles and raises if one failed. By then they have run on the GPU."""
        for i in list(self._ordered) if indices is None else indices:
            h = self._ordered.pop(i, None)
            if h is not None:
                mpi_ops.synchronize(h)


def hook_forward_waits(model, unit_modules, params, shard_of, weak):
    """Each unit's forward, and the model's (the root: whatever no one unit holds), waits
    before it runs for the gathers of those of `params` it holds (overlap_param_gather);
    see units.py for which parameters a unit holds. `weak` makes a hook that does not keep
    the optimizer alive. Returns the hook handles."""
    per_unit, root = assign(model, unit_modules, shard_of)
    ours = {shard_of[p].index for p in params}
    hooks = []
    for m, own in [(model, root)] + list(zip(unit_modules, per_unit)):
        own = tuple(i for i in own if i in ours)
        if own:
            hooks.append(m.register_forward_pre_hook(weak("_wait_hook", own)))
    return hooks


def _synchronize_all(*tables):
    for table in tables:
        for h in table.values():
            try:
                mpi_ops.synchronize(h)
            except Exception:  # noqa: BLE001 - the job is ending, or already reported it
                pass
        table.clear()
