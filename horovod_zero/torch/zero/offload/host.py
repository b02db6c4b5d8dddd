"""CPU offload of the optimizer (offload_optimizer="cpu"): fp32 master shards and
optimizer state in (pinned) host memory, stepped on the CPU.

[Note: the offload data flow]
- Gradients are reduce-scattered on the parameters' device as without offload.
  Each reduced shard is copied to a pinned host buffer (in the reduction's dtype:
  bf16 when reducing in bf16) on a side stream as soon as its reduction is done,
  while backward goes on (GradReducer hands it over, reduce.py).
- The step reads those host shards directly: the C++ Adam (cpu_adam.py) in one pass
  that also writes the param_dtype copy of the new values; any other optimizer is
  stepped by torch on fp32 copies, and its new values are cast after. Loss-scale
  unscaling and clipping become one factor the step applies, so the host gradients
  are never rewritten.
- The param_dtype copy goes back to the parameters' device into this rank's slot
  of each parameter's buffer, which is then allgathered in place (stages 1 and 2).
  At stage 3 it is the parameter's shard at rest: kept on the device, or in pinned
  host memory with offload_params="cpu", copied in by each gather.
- overlap_step=True steps each bucket on a worker thread as soon as its gradients
  are on the host, so the CPU step runs under backward (overlap.py).
Norms and overflow checks (core/norms.py) reduce host tensors, so those collectives
run over Gloo."""

import threading

import torch


def _host(numel, dtype, pin):
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


class HostOffload:
    """Host state of the offloaded step, and the GradReducer's sink without overlap_step
    (core/protocols.py GradSink)."""

    defers = False  # GradSink.defers
    takes_early = True
    one_reduction = False
    early_stream = None

    def __init__(self, storage, stepper, offload_params):
        self._st = storage
        self._cuda = storage.param_device.type == "cuda"
        self._pin = self._cuda  # pinned memory makes the copies asynchronous; it needs CUDA
        self.offload_params = offload_params
        self.stepper = stepper  # stepper.py's, or NvmeState
        self._d2h = torch.cuda.Stream(storage.param_device) if self._cuda else None
        self.h2d_stream = torch.cuda.Stream(storage.param_device) if self._cuda else None
        # Gathers copy host values in and enqueue their collectives here, so that a copy
        # runs beside the compute it prefetches for instead of in its queue (gather.py).
        self.gather_stream = torch.cuda.Stream(storage.param_device) if self._cuda else None
        self.grads = {}       # shard index -> host gradient shard (this step), or None: no rank had one
        self._host_grad = {}  # shard index -> its pinned buffer, kept across steps
        self._copies = {}     # shard index -> (event, device tensor) of its D2H copy in flight
        # Shard index -> version of out[index] that publish() copied to the device: a gather
        # reads that copy only while out[index] is unchanged since (any step or load of it
        # bumps the version), and uses the mark up.
        self._published = {}
        self.out = []         # per shard: the param_dtype copy on the host
        self.rest = []        # stage 3 without offload_params: the param_dtype shard on the device
        self.scale = 1.0      # unscale * clip factor for the step
        self.stats = {"d2h_bytes": 0, "h2d_bytes": 0}
        self._stats_lock = threading.Lock()  # the overlap worker counts too

    @property
    def shards(self):
        return self._st.shards

    def add_shards(self, shards, stores):
        """Allocates the param_dtype copies of newly sharded parameters and fills them
        from the masters."""
        for s, store in zip(shards, stores):
            self.out.append(_host(s.shard, store.dtype, self._pin))
            if self._st.sharded_params and not self.offload_params:
                self.rest.append(torch.empty(s.shard, dtype=store.dtype, device=store.device))
            else:
                self.rest.append(None)
        self.refresh([s.index for s in shards])

    # --- gradients in ---------------------------------------------------------

    def begin(self):
        pass

    def sums(self, s):
        return False  # the runtime averages: no multiply of this sink's to fold the mean into

    def set_unscale(self, factor):
        self.scale = factor

    def take_grad(self, s, outs, early=False, local=False):
        """This step's reduced gradient shard(s) of shard s (their reductions are done):
        starts the copy to the host. (`early`, `local`: for overlap.py's sink.)"""
        out = outs[0]
        if len(outs) > 1:  # several reductions this step: summed on the device first
            out = outs[0].float()
            for o in outs[1:]:
                out.add_(o)
        if not out.is_cuda:
            self.grads[s.index] = out
            return
        buf = self._host_grad.get(s.index)
        if buf is None or buf.dtype != out.dtype:
            buf = self._host_grad[s.index] = _host(s.shard, out.dtype, True)
        if len(outs) > 1:
            self._d2h.wait_stream(torch.cuda.current_stream(out.device))  # the sum above
        with torch.cuda.stream(self._d2h):
            buf.copy_(out, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        # Keeps the device shard alive until copied. In stream order: a shard taken again
        # (reduced again after an early hand-over) moves to the end, as its new copy did.
        self._copies.pop(s.index, None)
        self._copies[s.index] = (ev, out)
        self.stats["d2h_bytes"] += out.numel() * out.element_size()
        self.grads[s.index] = buf

    def take_grads(self, items):
        for s, outs, local in items:  # each shard's copy to the host starts at once
            self.take_grad(s, outs, local=local)

    def no_grad(self, s):
        self.grads[s.index] = None

    def grads_arrived(self, indices=None):
        """Waits for the gradient copies in flight (of `indices`, or all), releasing the GIL.
        The worker of overlap_step calls it too, while backward adds copies. The copies run
        in order on one stream, so one wait, for the last of them, covers them all (and
        every copy started before it): a thread needing the GIL back after each wait would
        queue behind backward's Python for each."""
        wanted = set(self._copies) if indices is None else set(indices)
        order = list(self._copies.items())  # insertion order: the stream's order
        last = max((k for k, (i, _) in enumerate(order) if i in wanted), default=None)
        if last is None:
            return
        order[last][1][0].synchronize()
        for i, entry in order[:last + 1]:
            if self._copies.get(i) is entry:  # not a copy the other thread started meanwhile
                del self._copies[i]

    def present_grads(self):
        """This step's host gradient shards that exist, once their copies have arrived."""
        self.grads_arrived()
        return [g for g in self.grads.values() if g is not None]

    # --- the step --------------------------------------------------------------

    def step(self, indices, threads=0, grads=None, hyper=None):
        """Steps the shards at `indices` that have a gradient; writes their param_dtype copies.
        `threads`: 0 for torch's intra-op threads. The overlap worker passes the `grads`
        (index -> host gradient) and `hyper` (the stepper's snapshot()) it was handed, as
        the step may run after zero_grad() and a change of the learning rate."""
        self.grads_arrived(indices)
        grads = self.grads if grads is None else grads
        items = [(i, grads[i]) for i in indices if grads.get(i) is not None]
        if items:
            with torch.profiler.record_function("hvd_zero.offload.host_step"):
                if hyper is None:
                    self.stepper.step(self._st, items, self.out, self.scale, threads)
                else:
                    self.stepper.step(self._st, items, self.out, self.scale, threads, hyper=hyper)

    def refresh(self, indices):
        """out <- master for shards whose master changed outside a step (construction, loads)."""
        with torch.no_grad():
            for i in indices:
                self.out[i].copy_(self._st.master_params[i].detach())
                if self.rest[i] is not None:
                    self.rest[i].copy_(self.out[i], non_blocking=self._pin)
        for i in indices:
            self._published.pop(i, None)

    def clear(self):
        self.grads.clear()
        self.scale = 1.0

    # --- parameters out -----------------------------------------------------------

    def _slot(self, i, store):
        s, r = self._st.shards[i], self._st.rank
        return store[r * s.shard:(r + 1) * s.shard]

    def publish(self, indices):
        """Copies the new values of `indices` to where the next gather reads them (on the
        current stream): the rest copy at stage 3, this rank's slot of the parameter's
        buffer at stages 1 and 2. With offload_params they stay on the host."""
        dsts, srcs = [], []
        for i in indices:
            if self._st.sharded_params and self.rest[i] is None:
                continue
            dsts.append(self.rest[i] if self.rest[i] is not None else self._slot(i, self._st.stores[i]))
            srcs.append(self.out[i])
            self._count_h2d(dsts[-1])
            self._published[i] = self.out[i]._version
        if dsts:  # one call for all: see grads_arrived() on the GIL
            torch._foreach_copy_(dsts, srcs, non_blocking=self._pin)

    def _count_h2d(self, t):
        if self._cuda:
            with self._stats_lock:
                self.stats["h2d_bytes"] += t.numel() * t.element_size()

    def source(self, i, store):
        """The tensor on the parameters' device that the gather of shard i reads: the rest
        copy, or this rank's slot of `store` (with the host values copied in, unless
        publish() did already this step)."""
        if self.rest[i] is not None:
            return self.rest[i]
        slot = self._slot(i, store)
        if self._published.pop(i, None) != self.out[i]._version or self._st.sharded_params:
            slot.copy_(self.out[i], non_blocking=self._pin)
            self._count_h2d(slot)
        return slot
