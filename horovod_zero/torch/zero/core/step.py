"""The step on the device (no offload): the reduced gradient shards become the fp32
master shards' .grad, the inner optimizer steps the master shards where they are,
and the parameters follow by allgather (stages 1 and 2) or at their next gather
(stage 3). offload/host_step.py is the other StepStrategy (core/protocols.py)."""

import contextlib

import torch

from horovod_zero.torch.zero.core import fused, master_adam, norms
from horovod_zero.torch.zero.core.gather import ParamGatherer
from horovod_zero.torch.zero.core.step_chunks import ChunkedStep


def fp32_copies(outs):
    """fp32 copies of these 1-D tensors: one allocation and one foreach cast kernel for all
    of them (per-tensor empty_like calls cost the host 146 allocations a step at 1.2B)."""
    flat = torch.empty(sum(o.numel() for o in outs), dtype=torch.float32, device=outs[0].device)
    copies = list(flat.split([o.numel() for o in outs]))
    torch._foreach_copy_(copies, outs)
    return copies


class MasterGrads:
    """GradSink: each shard's reductions, summed in fp32 and unscaled, as its master's .grad.
    A single reduction in param_dtype is deferred: cast when the step first reads it
    (take_deferred()), so that the step of the shards reduced first does not wait for
    the last reductions ([Note: the step in chunks] in core/step_chunks.py).

    [Note: the mean in the step's multiply]
    The runtime averages a reduce-scatter with a pass of its own over the output after
    the sum (a bf16 read and write of every shard: 2.4 ms a step of HBM time beside
    backward at 1.2B on 2 H100s, and the embedding's on the tail before its step). Where
    the step multiplies the gradient anyway, `sums(s)` is true: the shard is reduced as
    a Sum and the 1/size joins that multiply, in fp32 (the master Adam kernel's
    grad_scale, core/master_adam.py). The answer is kept per shard until its reductions
    are taken, so every reduction of a shard in one step uses one op and one factor."""

    takes_early = False
    one_reduction = False
    early_stream = None
    defers = True

    TAKE_BYTES = 64 << 20  # deferred outputs cast at once, as GradReducer.TAKE_BYTES

    def __init__(self, storage, folds=None):
        """`folds(s)`: whether the step multiplies shard s's gradient anyway (None: never)."""
        self._st = storage
        self._folds = folds
        self._mean = 1.0 / storage.size
        self._unscale = 1.0
        self._deferred = {}  # shard index -> its reduced output, in the order reduced
        self._order = None  # GradReducer.order_shards of the deferred outputs
        self._summed = {}  # shard index -> sums(s) for this step's reductions, until taken

    def begin(self):
        pass

    def sums(self, s):
        summed = self._summed.get(s.index)
        if summed is None:
            summed = self._summed[s.index] = self._folds is not None and self._st.size > 1 and bool(self._folds(s))
        return summed

    def _factor(self, index):
        """The factor shard `index`'s reductions are used with; forgets its sums() answer."""
        return self._unscale * self._mean if self._summed.pop(index, False) else self._unscale

    def set_unscale(self, factor):
        self._unscale = factor

    def take_grad(self, s, outs, early, local=False):
        self._deferred.pop(s.index, None)
        master = self._st.master_params[s.index]
        g = outs[0].to(device=master.device, dtype=torch.float32)  # no copy when already there
        for o in outs[1:]:
            g.add_(o.to(g.device))
        factor = self._factor(s.index)
        if factor != 1.0:
            g.mul_(factor)  # in fp32: the scaled fp16 values are exact, the unscaled ones may not be
        master.grad = g

    def take_grads(self, items):
        """The single bf16/fp16 reductions cast to fp32 by one foreach copy: one kernel for
        many shards instead of one each (146 kernels, 2.2 ms a step for a 1.2B model on an
        H200); the rest one by one."""
        cast = []
        for s, outs, local in items:
            self._deferred.pop(s.index, None)
            master = self._st.master_params[s.index]
            if len(outs) == 1 and outs[0].dtype != torch.float32 and outs[0].device == master.device:
                cast.append((master, outs[0], self._factor(s.index)))
            else:
                self.take_grad(s, outs, early=False, local=local)
        if not cast:
            return
        grads = fp32_copies([o for _, o, _ in cast])
        by_factor = {}
        for (master, _, factor), g in zip(cast, grads):
            master.grad = g
            if factor != 1.0:
                by_factor.setdefault(factor, []).append(g)
        for factor, gs in by_factor.items():
            torch._foreach_mul_(gs, factor)  # in fp32, as take_grad()

    def defer(self, items, order):
        """Each (s, out): shard s's one reduction of this step, its output `out` to be read
        only after order([s.index]) (GradReducer.order_shards)."""
        self._deferred = {s.index: out for s, out in items}  # nothing of an earlier step that raised
        self._order = order

    @property
    def deferred(self):
        """The indices of the deferred shards, in the order their reductions were submitted."""
        return list(self._deferred)

    def take_deferred(self, indices=None, raw=None):
        """The deferred shards at `indices` (all when None) become their masters' .grad, the
        current stream ordered after their reductions first, TAKE_BYTES of outputs cast at a
        time and freed as they are (the two never all exist at once). Those for which
        raw(index) is true are returned uncast instead, {index: output}, their masters'
        .grad None, as {index: (output, factor)}: to be stepped with that factor."""
        todo = list(self._deferred) if indices is None else [i for i in indices if i in self._deferred]
        if not todo:
            return {}
        self._order(todo)
        masters, shards = self._st.master_params, self._st.shards
        kept = {}
        batch, size = [], 0
        for i in todo:
            out = self._deferred.pop(i)
            if raw is not None and raw(i):
                kept[i] = (out, self._factor(i))
                masters[i].grad = None  # not a gradient left from an earlier step
                continue
            batch.append((shards[i], [out], False))
            size += out.numel() * out.element_size()
            if size >= self.TAKE_BYTES:
                self.take_grads(batch)
                batch, size = [], 0
        self.take_grads(batch)
        return kept

    def no_grad(self, s):
        # grad None: the inner optimizer skips the parameter (no weight decay, no momentum).
        self._deferred.pop(s.index, None)
        self._summed.pop(s.index, None)
        self._st.master_params[s.index].grad = None

    def clear(self):
        """zero_grad(): the deferred outputs are dropped (the reducer orders and releases
        their reductions)."""
        self._deferred.clear()
        self._summed.clear()


class MasterSource:
    """GatherSource: the fp32 master shards, cast to param_dtype in the gather's copy-in.

    [Note: the step writes the gather's input]
    At stages 1 and 2 with downcast, where the master Adam kernel runs (CUDA), a
    parameter kept in bf16 or fp16 is gathered from this rank's own slot of its buffer,
    in place: the kernel writes the new value there in param_dtype as it steps the shard
    (the gather's cast read 4 and wrote 2 bytes an element; the step writes the 2), and
    any other shard (a whole step, a load, a torch kernel) is cast into its slot here,
    all at once, before the gather. So every rank gathers every such parameter from a
    slot, whichever path stepped it, and the ranks agree on the gather's input dtype (a
    function of the buffer's). A slot the step wrote is read once, and only while its
    master is unchanged since (its version). Stage 3 has no parameter buffer between
    steps."""

    in_param_dtype = False
    stream = None

    def __init__(self, storage, write_slots=False):
        self._st = storage
        # Where the master Adam kernel can write them: without it a slot would only move the cast.
        self._write_slots = write_slots and not storage.sharded_params and \
            master_adam.available(storage.param_device) and storage.master_device == storage.param_device
        self._written = {}  # shard index -> (its slot, its master's version when written)
        # shard index -> (its buffer, this rank's slot of it): a view stays valid while drop()
        # and allocate() free and allocate the buffer's storage again, so it is made once.
        self._slot_views = {}

    def slot_dtype(self, i):
        """The dtype shard i is gathered from its slot in, or None (from the master)."""
        dtype = self._st.stores[i].dtype
        return dtype if self._write_slots and dtype in (torch.bfloat16, torch.float16) else None

    def _slot(self, i, store):
        cached = self._slot_views.get(i)
        if cached is not None and cached[0] is store:
            return cached[1]
        shard = self._st.shards[i].shard
        slot = store[self._st.rank * shard:(self._st.rank + 1) * shard]
        self._slot_views[i] = (store, slot)
        return slot

    def slots(self, indices):
        """This rank's slot of each of these shards' parameter buffers (allocated), for the
        step to write; the shards must share one slot_dtype()."""
        return [self._slot(i, self._st.allocate(i)) for i in indices]

    def wrote(self, indices, slots):
        """The step wrote these shards' new values into `slots` (queued on the current stream)."""
        masters = self._st.master_params
        self._written.update((i, (slot, masters[i]._version)) for i, slot in zip(indices, slots))

    def forget(self):
        self._written.clear()

    def before(self, indices):
        pass

    def inputs(self, items):
        """The gather inputs of (shard index, its allocated buffer) pairs: slots, those not
        written by the step cast from their masters in one kernel, or the masters."""
        st = self._st
        out, todo = [], []
        for i, store in items:
            if self.slot_dtype(i) is None:
                master = st.master_params[i].detach()
                out.append(master if master.device == st.param_device else master.to(st.param_device))
                continue
            written = self._written.pop(i, None)
            if written is not None and written[1] == st.master_params[i]._version:
                out.append(written[0])
                continue
            slot = self._slot(i, store)
            todo.append((slot, st.master_params[i].detach()))
            out.append(slot)
        if todo:
            torch._foreach_copy_([s for s, _ in todo], [m for _, m in todo])  # rounds as the gather's cast
        return out


class DeviceStep:
    """StepStrategy of the master shards on the parameters' device."""

    def __init__(self, storage, optimizer, downcast, fused_step, step_chunk_bytes=0, master_adam=False):
        self._st = storage
        self._optimizer = optimizer
        self._fused = fused_step  # Adam/AdamW left to its default kernel: the fused one (core/fused.py)
        self._source = source = MasterSource(storage, write_slots=downcast and master_adam)
        # The step in chunks, in the order of the reductions; at stages 1-2 each chunk's
        # gather under the next one's step.
        self.chunked = ChunkedStep(storage, optimizer, step_chunk_bytes, master_adam, source)
        self.sink = MasterGrads(storage, folds=self.chunked.steps_uncast)
        self.gatherer = ParamGatherer(storage, source, downcast)
        if fused_step:
            fused.prefer_fused(optimizer)

    def _take_deferred(self):
        if self.sink.defers:  # overlap_step's sink (core/early_step.py) defers nothing
            self.sink.take_deferred()

    def _grads(self):
        self._take_deferred()
        return [mp.grad for mp in self._st.master_params if mp.grad is not None]

    state_on_disk = False

    def add_shards(self, shards, stores):
        if self._fused:
            fused.prefer_fused(self._optimizer)  # the group just added

    def check_add_group(self):
        pass

    def check_step(self, closure):
        pass

    def check_clip(self):
        pass

    def found_inf(self):
        return norms.found_inf(self._grads(), self._st.groups.scope.process_set, self._st.param_device,
                               tag=self._st.groups.tag)

    def clip(self, max_norm, order_after):
        grads = self._grads()
        # Over the ranks holding one copy of every shard (all of them, or one node's).
        total = norms.global_norm(grads, self._st.groups.shard_set, self._st.param_device, order_after=order_after,
                                  tag=self._st.groups.tag)
        if grads:
            torch._foreach_mul_(grads, norms.clip_coef_tensor(total, max_norm).to(grads[0].dtype))
        return total.float()

    def step(self, closure, params, overlap):
        if closure is None:  # a closure runs forward and backward inside the step: it needs them
            params.drop_values()
        published = set()

        def publish(indices):
            params.publish(wait=False, indices=indices)
            published.update(indices)
        try:
            if self.chunked.applies(closure):
                # Stage 3 publishes once, after the step: its parameters are gathered at the next forward.
                if self._st.sharded_params:
                    return self.chunked.step(self.sink, lambda indices: None)
                return self.chunked.step(self.sink, publish, forward_order=overlap)
            self.chunked.chunks_last_step = 0
            self._take_deferred()
            return self._optimizer.step(closure)
        finally:  # also after a step that raised: the parameters take the masters' values again
            params.publish(wait=not overlap,
                           indices=[i for i in range(len(self._st.shards)) if i not in published])
            self._source.forget()  # a slot a failed gather left unread is not read later

    def skip(self):
        pass

    def refresh(self):
        fused.place_steps(self._optimizer)  # a load may have put `step` on the host
        self._source.forget()  # the masters were rewritten

    def params_ready(self, indices):
        pass

    def before_update(self):
        # The step writes the master shards the gathers read: on the GPU it runs after them.
        # The CPU does not wait, so it queues the step while the GPU finishes backward.
        self.gatherer.wait(stream_ordered=True)

    def forward_wait(self, indices):
        # On the GPU only: the CPU queues the unit's forward without waiting for the gather
        # to run (released by the next wait_for_params() or gather).
        if self.gatherer.in_flight:
            self.gatherer.wait(indices, stream_ordered=True)

    def check_skip(self):
        pass

    def check_between_steps(self):
        pass

    def materialized(self, write_back):
        return contextlib.nullcontext()

    def clear(self):
        if self.sink.defers:
            self.sink.clear()

    def stats(self):
        return {}
