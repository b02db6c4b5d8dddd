"""With Adam or AdamW, step() steps the master shards in chunks, in the order their
gradients were reduced; at stages 1 and 2 it queues each chunk's allgather as soon as
that chunk's step is queued, so that on the GPU the gather of one chunk runs under the
step of the next.

[Note: the step in chunks]
Stepped whole, the step waits for the last reduce-scatter of backward, and the
allgather of the new parameters runs after the whole step with nothing beside it,
since the next forward waits for every parameter (a 1.2B model on 2 GPUs: 6 ms of
fused AdamW, then 6 ms of gathers with the GPU's compute idle). In chunks they overlap:
- The reduced gradients stay in param_dtype until their chunk is stepped (core/step.py
  MasterGrads.defer); the stream waits for a chunk's reductions just before its cast
  and step. Chunks go in the order the reductions were submitted, so the shards
  reduced first are stepped while the last reductions (the embedding's, at the end of
  backward) still run. At stage 1, where every reduction starts at step(), the step of
  one chunk runs beside the reductions of the next.
- At stages 1 and 2 each chunk's allgather is queued after its step: what is left
  exposed is about one chunk's gather. Stage 3 gathers at the next forward.
- With overlap_param_gather the next forward waits for each unit's own gather, so the
  gathers are queued after the last chunk in the parameters' order: the first units'
  run first, the rest under the forward's compute. (Stepped in the parameters' order,
  every chunk waited for the tied embedding's reduce-scatter, the last of backward.)
- Same values: each chunk is torch's own update of its parameters (core/adam_subset.py),
  elementwise, with the group's kernel and hyperparameters at step(). On CUDA, a group
  that steps with torch's fused kernel is stepped from the uncast gradients instead
  (core/master_adam.py): the same update to fp32 rounding, without the cast.
- Ordering: the runtime records a gather's ready event on the caller's stream when it
  is enqueued, after its chunk's step and before the next chunk's, so the gather waits
  for its own chunk only.
- A chunk holds at least HOROVOD_ZERO_STEP_CHUNK_BYTES of fp32 masters, whole
  parameters, so a fused gather rarely spans two chunks; each chunk costs the host one
  kernel call and one enqueue more.
- Each chunk's fp32 gradients are dropped once it is stepped, and the inner optimizer's
  step() is called once after the chunks, with no gradient left: it steps nothing, and
  LR schedulers and step post-hooks see every step. An optimizer with a step pre-hook,
  a closure, a subclass or a differentiable group is stepped whole (adam_subset.
  steps_piecewise), after every gradient is cast."""

from horovod_zero.torch.zero.core import master_adam
from horovod_zero.torch.zero.core.adam_subset import adam_step, steps_piecewise


class ChunkedStep:
    def __init__(self, storage, optimizer, chunk_bytes, use_master_adam=False, source=None):
        """`source`: the gathers' MasterSource, whose slots the master Adam kernel writes
        ([Note: the step writes the gather's input] in core/step.py); None: it writes none."""
        self._st = storage
        self._optimizer = optimizer
        self._source = source
        self._master_adam = use_master_adam and master_adam.available(storage.param_device)
        self._chunk_numel = chunk_bytes // 4  # fp32 master elements
        self._total = (0, 0)  # (shards, their fp32 master elements)
        self.chunks_last_step = 0  # for tests and stats: 0 when the last step ran whole
        self.uncast_last_step = 0  # shards the last step stepped from uncast gradients (master_adam)

    def applies(self, closure):
        """Whether step(closure) is stepped in chunks: more than one chunk to make."""
        if not self._chunk_numel or closure is not None:
            return False
        return self._several_chunks() and steps_piecewise(self._optimizer)

    def _several_chunks(self):
        shards = self._st.shards
        if self._total[0] != len(shards):  # asked per shard in backward: summed once per add_groups()
            self._total = (len(shards), sum(s.shard for s in shards))
        return self._total[1] > self._chunk_numel

    def steps_uncast(self, s):
        """Whether shard s, reduced in this step, is stepped from its reduced gradient with a
        multiply of the step's own (the master Adam kernel's grad_scale) when the step goes
        in chunks. Only from what every rank shares (the kernel, the group's settings, the
        sizes), not from a step pre-hook one rank may hold: the ranks' reductions must agree
        on their op. A step that goes whole after all casts the gradient and multiplies apart."""
        if not self._master_adam or not self._chunk_numel:
            return False
        return master_adam.fits(self._optimizer.param_groups[s.group]) and self._several_chunks()

    def _chunks(self, deferred):
        """Whole shards, those whose gradient is already cast (or absent) first, then the
        `deferred` ones in the order they were reduced."""
        late = set(deferred)
        order = [s.index for s in self._st.shards if s.index not in late] + deferred
        chunk, numel = [], 0
        for i in order:
            chunk.append(i)
            numel += self._st.shards[i].shard
            if numel >= self._chunk_numel:
                yield chunk
                chunk, numel = [], 0
        if chunk:
            yield chunk

    def step(self, sink, publish, forward_order=False):
        """Steps every master shard that has a gradient, chunk by chunk, taking each chunk's
        deferred gradients from `sink` first and calling publish(indices) after it; then the
        inner optimizer's step(). `forward_order` (overlap_param_gather): publish() once,
        after the last chunk, with the indices in the parameters' order, so that the
        gathers the next forward waits for first are queued first."""
        masters, shards, groups = self._st.master_params, self._st.shards, self._optimizer.param_groups
        # CUDA: torch's fused Adam groups step from the reduced gradients uncast (core/master_adam.py).
        direct = [self._master_adam and master_adam.fits(g) for g in groups]
        self.chunks_last_step = self.uncast_last_step = 0
        stepped = []
        for chunk in self._chunks(sink.deferred):
            raw = sink.take_deferred(chunk, raw=lambda i: direct[shards[i].group])
            by_group = {}
            for i in chunk:
                if masters[i].grad is not None or i in raw:
                    by_group.setdefault(shards[i].group, []).append(i)
            for k, indices in by_group.items():
                uncast = {}  # (factor, the dtype of the gather's slot the kernel writes) -> shard indices
                for i in indices:
                    if i in raw:
                        slot_dtype = self._source.slot_dtype(i) if self._source is not None else None
                        uncast.setdefault((raw[i][1], slot_dtype), []).append(i)
                cast = [masters[i] for i in indices if i not in raw]  # before raw.pop() below
                for (factor, slot_dtype), ids in uncast.items():
                    self.uncast_last_step += len(ids)
                    slots = self._source.slots(ids) if slot_dtype is not None else None
                    master_adam.step(self._optimizer, groups[k], [masters[i] for i in ids],
                                     [raw.pop(i)[0] for i in ids], factor, copies=slots)
                    if slots is not None:
                        self._source.wrote(ids, slots)
                if cast:
                    adam_step(self._optimizer, groups[k], cast)
                for m in cast:
                    m.grad = None  # stepped (and freed early); a chunk that raised keeps them
            if forward_order:
                stepped += chunk
            else:
                publish(chunk)
            self.chunks_last_step += 1
        if stepped:
            publish(sorted(stepped))
        return self._optimizer.step()  # steps nothing: every gradient is gone
