"""Parameter gathering: the fp32 master shards allgathered into the parameters'
buffers with output_dtype=param_dtype, so the downcast happens in the runtime's
copy-in and only param_dtype crosses the wire (HOROVOD_ZERO_DOWNCAST=0 gathers
fp32 and casts afterwards, for comparison). Each call is one grouped enqueue per
dtype, which the runtime fuses into one collective; the handles stay here until
someone waits for them. What is gathered comes from the source (core/protocols.py
GatherSource): the master shards (core/step.py), or offload's param_dtype copies."""

import contextlib
import weakref

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.basics import _core


class ParamGatherer:
    def __init__(self, storage, source, downcast):
        self._storage = storage
        self._source = source
        # Cast in the gather's copy-in (param_dtype on the wire), unless turned off for
        # comparison (HOROVOD_ZERO_DOWNCAST=0) where the sources are fp32.
        self._cast_in = downcast or source.in_param_dtype
        self.in_flight = {}  # shard index -> allgather handle
        self._after = {}  # shard index -> (buffer, fp32 copy) to cast once gathered (downcast off)
        self._ordered = {}  # shard index -> handle the stream waits for, not yet synchronized
        # A dropped optimizer lets go of its handles, which hold its buffers in the runtime.
        weakref.finalize(self, _synchronize_all, self.in_flight, self._ordered).atexit = False

    def gather(self, indices):
        """Enqueues the gathers of the master shards at `indices` into their buffers
        (at stage 3 allocating them first)."""
        st = self._storage
        self._source.before(indices)
        self.wait(indices)  # one gather of a parameter in flight at a time: the names stay unique
        self.release(indices)
        by_dtype = {}
        for i in indices:
            out = st.unshard(i) if st.sharded_params else st.allocate(i)
            by_dtype.setdefault(out.dtype, []).append((i, out))
        stream = self._source.stream
        if stream is not None and by_dtype:
            # The buffers come from the compute stream's pool and may be what it still reads.
            stream.wait_stream(torch.cuda.current_stream(st.param_device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._enqueue(by_dtype)

    def _enqueue(self, by_dtype):
        st = self._storage
        for dtype, items in by_dtype.items():
            ins = self._source.inputs(items)
            if self._cast_in:
                outs, out_dtype = [o for _, o in items], dtype
            else:
                outs = [torch.empty(o.numel(), dtype=torch.float32, device=o.device) for _, o in items]
                self._after.update({i: (o, full) for (i, o), full in zip(items, outs)})
                out_dtype = None
            names = [f"{st.groups.tag}.param.{i}" for i, _ in items]
            handles = ops._enqueue(_core.OP_ALLGATHER, ins, outs, names, output_dtype=out_dtype,
                                   process_set=st.groups.shard_set)
            self.in_flight.update({i: h for (i, _), h in zip(items, handles)})

    def wait(self, indices=None, stream_ordered=False):
        """Waits for the gathers of `indices` (all when None) that are in flight.
        `stream_ordered`: only orders the current stream after them (CUDA), so that the CPU
        need not wait for them to run; release() synchronizes them later."""
        ordered = []
        for i in list(self.in_flight) if indices is None else indices:
            h = self.in_flight.pop(i, None)
            if h is None:
                continue
            if stream_ordered and i not in self._after:
                self._ordered[i] = h  # first: if the wait is interrupted, release() still has it
                ordered.append(h)
                continue
            ops.synchronize(h)
            if i in self._after:
                out, full = self._after.pop(i)
                out.copy_(full)
        if ordered:  # one call: one stream wait per fused collective, not per tensor
            # let_go: a freed unit's memory is reused on this stream, after the gather.
            ops._wait_stream(ordered, self._storage.param_device, let_go=True)

    def release_finished(self):
        """Releases the stream-ordered gathers that have run, without waiting for others."""
        for i, h in list(self._ordered.items()):
            if ops.poll(h) and self._ordered.pop(i, None) is h:
                ops.synchronize(h)

    def release(self, indices=None):
        """Synchronizes the gathers that wait() only ordered the stream after: releases
        their handles and raises if one failed. By then they have run on the GPU."""
        for i in list(self._ordered) if indices is None else indices:
            h = self._ordered.pop(i, None)
            if h is not None:
                ops.synchronize(h)


def _synchronize_all(*tables):
    for table in tables:
        for h in table.values():
            try:
                ops.synchronize(h)
            except Exception:  # noqa: BLE001 - the job is ending, or already reported it
                pass
        table.clear()
