"""overlap_step=True without offload: each gradient shard is stepped on the device as
soon as its reduce-scatter is queued, on a stream of its own, so the optimizer step
runs beside the rest of backward instead of after it. step() then only orders the
compute stream after that stream and publishes the new values.

[Note: the device step inside backward]
- The shards stepped early, and the refusals, are the host's: [Note: stepping inside
  backward] in offload/overlap.py. Clipping and loss scaling need every gradient
  before the first update, and a second reduction of a shard in one step would be
  stepped twice: all refused, not approximated.
- Ordering. The step stream waits for the reduction's event (GradReducer asks the
  runtime without blocking, at each bucket); the compute stream waits for the step
  stream at step(), before anything reads the masters again (stage 1-2's allgather,
  stage 3's next gathers). A gather that reads a shard's master for backward runs
  before that unit's backward, so before its reduction and its step.
- Memory. A reduced output is allocated on the compute stream and read on the step
  stream, so it is recorded there: the caching allocator does not hand it to
  backward again before the step has read it. The fp32 gradient is made on the step
  stream and lives only for its kernel, so the masters' .grad stay None and backward
  holds no fp32 gradients.
- The kernel is torch's own Adam/AdamW (core/adam_subset.py, fused on CUDA unless
  the group asked for another): checkpoints and results are those of optimizer.step()
  over the same shards. The inner optimizer's step() is still called once at step(), with no gradient
  left, so that LR schedulers and step hooks see one step() per step."""

import contextlib

import torch

from horovod_zero.torch.zero.core import hyper
from horovod_zero.torch.zero.core.adam_subset import STEPPABLE, adam_step
from horovod_zero.torch.zero.core.step import DeviceStep, fp32_copies

# Shards handed over during backward are stepped in batches of about this many elements:
# each call costs the host about half a millisecond, which at micro-batch 1 is the step's
# critical path (one call per 32 MiB bucket made a 1.2B model's step 1.5x slower on 2 GPUs).
_BATCH_NUMEL = 128 << 20


class EarlySink:
    """GradSink (core/protocols.py): steps each shard as its reduced gradient arrives."""

    defers = False  # GradSink.defers
    takes_early = True
    one_reduction = True  # GradReducer refuses a second reduction of a shard in one step

    def __init__(self, storage, optimizer):
        self._st = storage
        self._optimizer = optimizer
        cuda = storage.param_device.type == "cuda"
        # CPU ranks: no stream; GradReducer hands each shard over once its reduction is done.
        self.early_stream = torch.cuda.Stream(storage.param_device) if cuda else None
        self.hyper = None  # hyper.snapshot() from backward's first gradient until step()
        self.early = 0     # shards whose step was queued during backward, since construction (stats)
        # Handed over (the stream ordered after their reductions), not stepped yet: (shard, outs).
        self._queued, self._queued_numel = [], 0

    def begin(self):
        if self.hyper is None:
            self.hyper = hyper.snapshot(self._optimizer.param_groups)

    def sums(self, s):
        return False  # the runtime averages: no multiply of this sink's to fold the mean into

    def set_unscale(self, factor):
        assert factor == 1.0, "overlap_step refuses loss scaling (options.py)"

    def take_grad(self, s, outs, early, local=False):
        self._queued.append((s, outs))
        self._queued_numel += s.shard
        if self._queued_numel >= _BATCH_NUMEL:
            self.early += early * len(self._queued)
            self._step_queued()

    def take_grads(self, items):
        self._queued += [(s, outs) for s, outs, _ in items]
        self._step_queued()

    def _step_queued(self):
        items, self._queued, self._queued_numel = self._queued, [], 0
        self._step(items)

    def no_grad(self, s):
        self._st.master_params[s.index].grad = None  # torch skips it: no weight decay, no momentum

    def _stream(self):
        return torch.cuda.stream(self.early_stream) if self.early_stream is not None else contextlib.nullcontext()

    def _step(self, items):
        if not items:
            return
        self.begin()  # gradients set as p.grad = g, without a backward hook: this step's all the same
        masters, shards = self._st.master_params, self._st.shards
        by_group = {}
        with self._stream(), torch.no_grad():
            singles = [(s, outs[0]) for s, outs in items if len(outs) == 1]
            grads = fp32_copies([o for _, o in singles]) if singles else []
            for (s, _), g in zip(singles, grads):
                by_group.setdefault(shards[s.index].group, []).append((masters[s.index], g))
            for s, outs in items:
                if len(outs) > 1:  # summed in fp32, as MasterGrads does
                    g = outs[0].to(torch.float32)
                    for o in outs[1:]:
                        g.add_(o)
                    by_group.setdefault(shards[s.index].group, []).append((masters[s.index], g))
                if self.early_stream is not None:
                    for o in outs:
                        o.record_stream(self.early_stream)
            for k, pairs in by_group.items():
                self._adam(self._optimizer.param_groups[k], pairs)

    def _adam(self, group, pairs):
        """optimizer.step() over these masters only, with this step's hyperparameters."""
        params = [m for m, _ in pairs]
        for m, g in pairs:
            m.grad = g
        try:
            adam_step(self._optimizer, group, params, self.hyper.get(id(group)) or hyper.hyper_of(group))
        finally:
            for m in params:
                m.grad = None  # the fp32 gradient lives only for the step

    def join(self):
        """The current stream waits for every step queued so far."""
        self._step_queued()
        if self.early_stream is not None:
            torch.cuda.current_stream(self._st.param_device).wait_stream(self.early_stream)

    def end_step(self):
        self.hyper = None


class EarlyStep(DeviceStep):
    """StepStrategy with overlap_step=True on the device: DeviceStep whose sink steps."""

    def __init__(self, storage, optimizer, downcast, fused_step):
        if type(optimizer) not in STEPPABLE:
            raise ValueError(f"overlap_step=True steps Adam or AdamW shards during backward; "
                             f"{type(optimizer).__name__} is stepped at step(). Use overlap_step=False.")
        super().__init__(storage, optimizer, downcast, fused_step)
        self.sink = EarlySink(storage, optimizer)

    def add_shards(self, shards, stores):
        super().add_shards(shards, stores)
        if any(g.get("differentiable") for g in self._optimizer.param_groups):
            raise ValueError("overlap_step=True with differentiable=True: the early step runs without autograd. "
                             "Use overlap_step=False.")

    def check_step(self, closure):
        if closure is not None:
            raise ValueError("step(closure) with overlap_step=True: each shard is stepped as its gradient arrives "
                             "in backward; call the closure (forward and backward) before step().")
        if self.sink.hyper is not None:
            hyper.check_unchanged(self.sink.hyper, hyper.snapshot(self._optimizer.param_groups))

    def check_clip(self):
        raise RuntimeError("clip_grad_norm_ with overlap_step=True: each shard is stepped during backward, before "
                           "the global norm is known. Use overlap_step=False to clip.")

    def step(self, closure, params, overlap):
        # finish() stepped what backward did not: only the ordering and the new values are left.
        self.sink.join()
        self.sink.end_step()
        # Every master's .grad is None now, so this steps nothing; it is called so that LR
        # schedulers and step hooks on the inner optimizer see one step() per step.
        self._optimizer.step()
        params.publish(wait=not overlap)
        return None

    def stats(self):
        return {"stepped_early": self.sink.early}

    def check_skip(self):
        self._refuse_after_backward(
            "zero_grad() after backward with overlap_step=True: each parameter shard is stepped as its gradient "
            "arrives in backward, so this step cannot be skipped. Call step() to complete it, or use "
            "overlap_step=False to decide after backward whether to step.")

    def check_between_steps(self):
        self._refuse_after_backward(
            "The optimizer's state was read or loaded (state_dict(), load_state_dict(), a checkpoint or an "
            "export) between backward and step() with overlap_step=True: the step of this step's parameter "
            "shards began during backward, so the state would mix two steps. Do it after step().")

    def _refuse_after_backward(self, message):
        # Whenever backward began, not only where a shard was stepped: that depends on each
        # rank's timing, and the ranks must agree.
        if self.sink.hyper is not None:
            raise RuntimeError(message)
