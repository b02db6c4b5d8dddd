"""Gradient reduction: full gradients reduce-scattered (op Average) into this
rank's shards. Stages 2 and 3 start as each gradient becomes ready in backward,
in buckets; stage 1, a coalescing block, and backward_passes_per_step=N wait so
that each parameter is reduced once per step. A full gradient is dropped from the
parameter when it is taken; the runtime holds it until its collective is queued on the
GPU (CUDA; then the caching allocator keeps it until the collective has run) or done.
Where the reduced shards go is the sink's business (core/protocols.py GradSink): the
master shards' .grad (core/step.py), or the host (offload/).

[Note: one count of reductions on every rank]
The k-th reduction of a parameter in a step is the collective <tag>.grad.<index>.<k>, so
every rank must make as many reductions of each parameter, or one waits for a name the
others never submit. During backward each rank reduces what its own backward produced,
and ranks may differ: a branch one rank's forward took (a reduction each pass without
coalescing), or a parameter used in more passes than backward_passes_per_step on one
rank. So before the last reductions of a step (submit_rest(): at step() and at the end
of a coalescing block) and before dropping them (discard()), one small allreduce takes,
per parameter, the most reductions any rank needs, and each rank makes up the difference
with reductions of zeros, which add nothing to the sum. The same allreduce says which
parameters any rank had a gradient for."""

import collections
import contextlib

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.basics import _core


class GradReducer:
    TAKE_BYTES = 64 << 20  # reduced outputs handed to the sink at once in finish()

    def __init__(self, storage, sink, eager, backward_passes_per_step, reduce_dtype, bucket_bytes, tuning=None):
        self._storage = storage
        self._groups = storage.groups
        self._sink = sink
        self._eager = eager  # reduce in backward (stages 2 and 3) rather than at step()
        self._bpps = backward_passes_per_step
        self._reduce_dtype = reduce_dtype
        self._bucket_limit = bucket_bytes
        # HOROVOD_AUTOTUNE: the bucket size may change at each step ([Note: tuned ZeRO settings]).
        self._tuning = tuning
        # shard index -> [(handle, output)], one per reduction this step. A handle keeps the
        # full gradient it reduces alive until it lets go of it (CUDA, once queued) or is
        # waited for: _drain() waits for those finished at each flush.
        self._pending = {}
        # Handles of reductions finish() only ordered the GPU after: released (their
        # failures raised) at the next finish() or wait_for_params(); they hold nothing.
        self._ordered = []
        self._had_grad = {}  # shard index -> whether this rank had a gradient for it this step
        self._had_anywhere = []  # per trained parameter: whether any rank had one (submit_rest())
        self._began = False  # a gradient hook ran since the last step (or discard)
        self._bucket, self._bucket_bytes = [], 0  # gradients taken, not yet submitted
        self._delay = []  # shard index -> backward passes until its next reduction
        self._reduced = False  # the sink holds this step's reduced gradients
        self.coalescing = False
        # A sink that takes_early (offload) gets each shard as soon as its reduction is done,
        # so that its copy to the host runs under the rest of backward.
        self._done = {}  # shard index -> outputs of reductions already finished this step
        self._undrained = collections.deque()  # shard indices submitted, in order, not yet drained
        # CUDA: the handles that let go of their full gradients once queued on the GPU
        # (_let_go_inputs()), and the side stream that waits for them so that the caching
        # allocator reuses that memory only after the reduction has run.
        cuda = storage.param_device.type == "cuda"
        self._release_stream = torch.cuda.Stream(storage.param_device) if cuda else None
        self._letting_go = []  # CUDA: handles submitted, not let go yet (released ones are dropped too)
        self._sunk = set()  # shard indices whose first reduction the sink took early
        # After finish(): shard index -> its reductions the GPU is not ordered after yet,
        # until the sink reads the shard (order_shards()); release() orders the rest.
        self._unordered = {}

    @property
    def busy(self):
        """Whether gradients of this step are waiting for step()."""
        return bool(self.coalescing or self._pending or self._bucket or self._reduced)

    def extend(self, count):
        self._delay += [self._bpps] * count

    def on_grad_ready(self, p):
        """A parameter's gradient is accumulated (post-accumulate-grad hook)."""
        self._sink.begin()  # overlap_step: the step's hyperparameters are the ones backward began with
        self._began = True
        if self.coalescing or not self._eager:
            return
        s = self._storage.shard_of[p]
        self._delay[s.index] -= 1
        if self._delay[s.index] > 0:
            return
        self._delay[s.index] = self._bpps
        # Gradients wait in a bucket until it holds HOROVOD_ZERO_BUCKET_BYTES: one group
        # of several tensors fuses into one large collective instead of many small ones.
        taken = self._take(s, p)
        self._bucket.append(taken)
        self._bucket_bytes += s.padded * taken[2].itemsize
        if self._bucket_bytes >= self._bucket_limit:
            self.flush()

    def flush(self):
        bucket, self._bucket, self._bucket_bytes = self._bucket, [], 0
        self._submit(bucket)
        if self._sink.early_stream is not None:
            self._hand_queued()
        self._let_go_inputs()
        self._drain()

    def _let_go_inputs(self):
        """The reductions queued on the GPU since the last flush stop holding their full
        gradients, which count as freed from then on instead of from when the CPU sees them
        finish: the CPU runs units ahead of the GPU, and their gradients would otherwise
        all be allocated at once ([Note: letting go once queued] in python/adapter.cc).
        A handle _drain() released meanwhile counts as settled there."""
        if self._letting_go:
            todo = self._letting_go
            settled = ops._try_let_go(todo, self._storage.param_device, self._release_stream)
            self._letting_go = [h for h, done in zip(todo, settled) if not done]

    def _stream(self):
        """The sink's early stream as the current one (overlap_step on the device), else nothing."""
        stream = self._sink.early_stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _hand_queued(self, wait=False):
        """A sink with an early_stream gets each shard whose one reduction is queued on the
        GPU, that stream ordered after it: its step runs there beside the rest of backward,
        and the CPU never waits for the runtime (a reduction not queued yet is handed at a
        later flush); wait=True (at step()) waits until each is queued. The shards eligible
        are those _drain() would hand over once done: [Note: stepping inside backward]."""
        if not self._groups.final_after_reduce_scatter:
            return
        device, shards = self._storage.param_device, self._storage.shards
        with self._stream():
            for index in self._undrained:
                handles = self._pending[index]
                if index in self._sunk or len(handles) != 1 or index in self._done or not self._had_grad.get(index):
                    continue
                h, out = handles[0]
                if wait:
                    ops._wait_stream(h, device)
                elif not ops._try_wait_stream(h, device):
                    continue
                self._sunk.add(index)
                self._sink.take_grad(shards[index], [out], early=not wait)

    def _drain(self, wait=False):
        """Takes the outputs of the reductions that have finished, in submission order, so
        that their handles let go of the full gradients they reduced: backward then holds
        only the gradients still in flight. Stops at the first one still running (they
        finish in order), so a flush polls few handles; wait=True waits for each instead.
        A sink that takes_early gets each shard here, unless a shard is final only after the
        average of its replicas (hybrid sharding)."""
        early = self._sink.takes_early and self._groups.final_after_reduce_scatter
        while self._undrained:
            index = self._undrained[0]
            handles = self._pending[index]
            while handles and (wait or ops.poll(handles[0][0])):
                h, out = handles.pop(0)
                ops.synchronize(h)
                self._done.setdefault(index, []).append(out)
            if handles:
                return
            self._undrained.popleft()
            done = self._done[index]
            if early and len(done) == 1 and self._had_grad.get(index) and index not in self._sunk:
                self._sunk.add(index)
                self._sink.take_grad(self._storage.shards[index], done, early=True)

    def _take(self, s, p):
        """Takes p's gradient for reduction: later backward passes start afresh."""
        g, p.grad = p.grad, None
        self._had_grad[s.index] = self._had_grad.get(s.index, False) or g is not None
        return s, g, self._reduce_dtype or (g.dtype if g is not None else p.dtype)

    def _padded_grad(self, s, g, dtype, device):
        if g is not None and s.numel == s.padded and g.dtype == dtype and g.is_contiguous():
            return g.view(-1)  # no padding needed: reduce-scatter it where it is
        buf = torch.zeros(s.padded, dtype=dtype, device=device)
        if g is not None:
            buf[:s.numel].copy_(g.reshape(-1))
        return buf

    def _submit(self, taken):
        """Reduce-scatters these taken (shard, gradient, dtype) as one group."""
        if not taken:
            return
        # The last step's reductions no one read (no gradient anywhere, or a step that raised)
        # are ordered first: a name is submitted again only once its last op has been queued.
        if self._unordered:
            self.order_shards(list(self._unordered))
        device = self._storage.param_device
        ins = [self._padded_grad(s, g, dtype, device) for s, g, dtype in taken]
        outs = [b.new_empty(s.shard) for b, (s, _, _) in zip(ins, taken)]
        # Sum where the sink applies the mean in a multiply of its own ([Note: the mean in
        # the step's multiply] in core/step.py), else the runtime's Average.
        summed = [self._sink.sums(s) for s, _, _ in taken]
        # The k-th reduction of a parameter in a step has its own name; the ranks make as
        # many of each: [Note: one count of reductions on every rank].
        names, seen = [], {}
        one_reduction = self._sink.one_reduction
        for s, _, _ in taken:
            if one_reduction and (s.index in self._pending or s.index in seen):
                raise RuntimeError(
                    f"Parameter '{s.name}' was reduced a second time in one step, but overlap_step=True steps each "
                    "parameter with its first reduced gradient. Run one backward per step, or accumulate with "
                    "backward_passes_per_step=N or inside `with opt.coalesce_grad_reduction():`.")
            k = len(self._pending.get(s.index, ())) + len(self._done.get(s.index, ())) + seen.get(s.index, 0)
            seen[s.index] = seen.get(s.index, 0) + 1
            names.append(f"{self._groups.tag}.grad.{s.index}.{k}")
        # The runtime holds the inputs until their collective is done, then frees them.
        handles = [None] * len(taken)
        for op, want in ((ops.Sum, True), (ops.Average, False)):
            idx = [k for k, x in enumerate(summed) if x == want]
            if idx:
                hs = ops._enqueue(_core.OP_REDUCESCATTER, [ins[k] for k in idx], [outs[k] for k in idx],
                                  [names[k] for k in idx], op, process_set=self._groups.shard_set)
                for k, h in zip(idx, hs):
                    handles[k] = h
        for h, out, (s, _, _) in zip(handles, outs, taken):
            self._pending.setdefault(s.index, []).append((h, out))
        if self._release_stream is not None:
            self._letting_go += handles
        self._undrained.extend(s.index for s, _, _ in taken)

    def _trained(self):
        st = self._storage
        return [(s, p) for s, p in zip(st.shards, st.params) if p.requires_grad]

    def submit_rest(self):
        """Submits what is left of this step, so that every rank has made the same reductions
        of every trained parameter: [Note: one count of reductions on every rank]."""
        self.flush()
        trained = self._trained()
        counts = [self._count(s) for s, _ in trained]
        # Per parameter: the reductions this rank needs (a gradient accumulated since its last
        # reduction, or none made yet, needs one more), and whether it had a gradient.
        mine = [[n + (1 if p.grad is not None or n == 0 else 0) for n, (_, p) in zip(counts, trained)],
                [1 if self._had_grad.get(s.index) or p.grad is not None else 0 for s, p in trained]]
        tuning = self._tuning.rows() if self._tuning is not None else []
        needed, had, *agreed = self._max_over_ranks(mine + tuning)
        if tuning:
            self._tuning.adopt(agreed)
            self._bucket_limit = self._tuning.bucket_bytes
        self._had_anywhere = [f > 0 for f in had]
        self._make_up(trained, counts, needed)

    def _make_up(self, trained, counts, needed):
        """Submits, per parameter, the reductions this rank lacks of the `needed` ones: the
        first takes what is left of its gradient (None: zeros), the rest are zeros."""
        self._submit([self._take(s, p) for (s, p), n, want in zip(trained, counts, needed)
                      for _ in range(int(want) - n)])

    def _count(self, s):
        """The reductions of shard s this rank has submitted this step."""
        return len(self._pending.get(s.index, ())) + len(self._done.get(s.index, ()))

    def _max_over_ranks(self, rows):
        """Each row of small integers (rows may differ in length), its elementwise maximum
        over the optimizer's ranks."""
        if not rows[0]:
            return [[] for _ in rows]
        # On the host (Gloo), even with GPUs: over NCCL it would queue behind the step's
        # reduce-scatters, and reading it would make the CPU wait for all of them to run,
        # leaving the GPU idle while the CPU then queues the optimizer step.
        t = torch.tensor([x for row in rows for x in row], dtype=torch.float32)
        flat = ops.synchronize(ops._allreduce_async(t, f"{self._groups.tag}.reductions", ops.Max, 1.0, 1.0,
                                                    self._groups.scope.process_set)).tolist()
        out, at = [], 0
        for row in rows:
            out.append(flat[at:at + len(row)])
            at += len(row)
        return out

    def finish(self, unscale):
        """Waits for this step's reductions and hands each shard's outputs to the sink, with
        the factor `unscale` (loss-scale unscaling) they are used with."""
        if self._reduced:
            return
        self.release()
        # First: a reduction this rank waits for below may be one the other ranks submit only
        # in submit_rest() (their zeros for a parameter only this rank had a gradient for).
        self.submit_rest()
        self._sink.set_unscale(unscale)
        if self._sink.early_stream is not None:
            self._hand_queued(wait=True)
        elif self._sink.takes_early:
            # The CPU is usually well ahead of backward on the GPU: the sink gets each shard
            # as its reduction finishes there, so its copy to the host (and with
            # overlap_step its host step) runs beside the rest of backward.
            self._drain(wait=True)
        with self._stream():  # the rest is ordered, and taken, on the sink's stream too
            self._take_rest()
        self._reset()
        self._reduced = True

    def _take_rest(self):
        """finish(): hands the sink what it did not take early, in the order the reductions
        were submitted, and orders the GPU after them. A sink that `defers` is handed the
        single reductions without that order: it orders the stream after a shard's
        reductions (order_shards()) only when it first reads it, so that the step of the
        shards reduced first runs while the last reductions still run on the GPU ([Note:
        the step in chunks] in core/step_chunks.py)."""
        trained = self._trained()
        had = dict(zip((s.index for s, _ in trained), self._had_anywhere))
        submitted = {index: k for k, index in enumerate(self._pending)}  # first submission of each
        trained.sort(key=lambda sp: submitted.get(sp[0].index, -1))  # those taken early first
        handles = {s.index: [h for h, _ in self._pending.get(s.index, ())] for s, _ in trained}
        outputs = {s.index: self._done.pop(s.index, []) + [out for _, out in self._pending.pop(s.index, ())]
                   for s, _ in trained}
        final = self._groups.final_after_reduce_scatter
        if not final:
            self.order_after([h for hs in handles.values() for h in hs])
            items = [(s, sum(outputs[s.index][1:], outputs[s.index][0])) for s, _ in trained if had[s.index]]
            # Each shard waits only for its own average, when the sink reads it: the step of the
            # shards averaged first runs under the rest of the allreduces.
            handles = {s.index: [h] for (s, _), h in zip(items, self._groups.average_replicas(items))}
            outputs.update((s.index, [t]) for s, t in items)
            del items  # the outputs hold them now, freed one by one below
        self._unordered = handles
        # Popped, and handed over TAKE_BYTES at a time: the reduced outputs (param_dtype) are
        # freed as the sink takes them (MasterGrads makes fp32 .grad), so the two never all
        # exist at once, and the sink still casts many shards in one kernel.
        batch, deferred, unread, size = [], [], [], 0
        for s, _ in trained:
            outs = outputs.pop(s.index)
            if not had[s.index]:
                self._sink.no_grad(s)  # no rank had a gradient: the inner optimizer skips it, as torch would
                unread.append(s.index)
            elif s.index in self._sunk and len(outs) == 1:
                pass
            elif self._sink.defers and len(outs) == 1:
                deferred.append((s, outs[0]))
            else:
                batch.append((s, outs, self._had_grad.get(s.index, False)))
                size += sum(o.numel() * o.element_size() for o in outs)
                if size >= self.TAKE_BYTES:
                    self._hand(batch)
                    batch, size = [], 0
        self._hand(batch)
        # Outputs no one reads: ordered on the side stream (on the host: waited for), which
        # the compute stream never waits on.
        with torch.cuda.stream(self._release_stream) if self._release_stream is not None else contextlib.nullcontext():
            self.order_shards(unread)
        if deferred:
            self._sink.defer(deferred, self.order_shards)
        else:
            self.order_shards(list(self._unordered))

    def _hand(self, batch):
        self.order_shards([s.index for s, _, _ in batch])
        self._sink.take_grads(batch)

    def order_shards(self, indices):
        """Orders the current stream after this step's reductions of the shards at
        `indices` that it is not ordered after yet (see _take_rest())."""
        handles = [h for i in indices for h in self._unordered.pop(i, ())]
        self.order_after(handles)

    def order_after(self, handle):
        """Orders the work queued next on the current stream after this op, or a list of them
        (the reductions of this step, or the gradient norm's allreduce). On GPUs
        the CPU does not wait for it to run: it goes on to queue the step, so the GPU is not
        left idle between the last reduction and the step's kernels."""
        handles = handle if isinstance(handle, list) else [handle]
        if not handles:
            return
        device = self._storage.param_device
        if device.type != "cuda" or (self._sink.takes_early and self._sink.early_stream is None):  # offload: the host reads it
            ops.synchronize(handles)
            return
        ops._wait_stream(handles, device, let_go=True)  # one call, one wait per fused collective
        self._ordered += handles

    def release(self, wait=True):
        """Releases the reductions finish() only ordered the GPU after, raising if one
        failed; wait=False: only those that have run (zero_grad() right after step() must
        not make the CPU wait for the GPU). At the next finish() they have run long ago."""
        self.order_shards(list(self._unordered))  # a handle is ordered after before it is released
        n = len(self._ordered) if wait else next(
            (k for k, h in enumerate(self._ordered) if not ops.poll(h)), len(self._ordered))
        done, self._ordered = self._ordered[:n], self._ordered[n:]
        if done:
            ops.synchronize(done)

    def hand_over(self):
        """The step took this step's reduced gradients: the next backward starts a new step
        (finish() reduces again)."""
        self._reduced = False

    def discard(self):
        """zero_grad() before step() (or after a backward that raised): as in torch, the
        gradients so far are dropped. The reductions already submitted run on every rank,
        so they are waited for, and their results forgotten; the next step starts afresh.
        After a backward, the ranks first make the same reductions, as at submit_rest(): a
        rank that submitted one the others did not would wait for them forever, or pair it
        with their next step's. (A rank whose backward gave no gradient at all cannot tell
        that a backward ran; it would not join, and the stall check names it.)"""
        self._bucket, self._bucket_bytes = [], 0
        self.release(wait=False)
        if self._began:
            trained = self._trained()
            counts = [self._count(s) for s, _ in trained]
            (needed,) = self._max_over_ranks([counts])
            self._make_up(trained, counts, needed)
        handles = [h for hs in self._pending.values() for h, _ in hs]
        if handles:
            ops.synchronize(handles)
        self._reset()
        self._reduced = False

    def _reset(self):
        """Forgets this step's reductions: the next step starts afresh."""
        self._pending.clear()
        self._done.clear()
        self._undrained.clear()
        self._letting_go.clear()
        self._sunk.clear()
        self._had_grad.clear()
        self._delay = [self._bpps] * len(self._storage.shards)
        self._began = False

    @contextlib.contextmanager
    def coalesce(self):
        if self.coalescing:
            raise RuntimeError("coalesce_grad_reduction() blocks do not nest.")
        self.coalescing = True
        try:
            yield
        finally:
            self.coalescing = False
        self.submit_rest()
