"""Who steps the host shards: the C++ Adam/AdamW (one pass that reads the gradient
in its reduced dtype and writes the param_dtype copy), or torch's own step of the
inner optimizer on fp32 copies of the gradients, for every other optimizer."""

import torch

from horovod_zero.torch.zero.offload.cpu_adam import CpuAdam, chosen_isa, not_covered_reason



class FastStepper:
    fast = True

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self._adam = CpuAdam(optimizer)

    def step(self, storage, items, outs, scale, threads=0, hyper=None):
        """items: (shard index, host gradient); writes outs[index] for each. `threads`: 0
        for torch's intra-op threads. `hyper`: a snapshot() to step with."""
        groups = self._optimizer.param_groups
        masters, shards = storage.master_params, storage.shards
        self._adam.step_items([(groups[shards[i].group], masters[i], g, outs[i]) for i, g in items],
                              grad_scale=scale, threads=threads, hyper=hyper)

    def snapshot(self):
        """The hyperparameters the step reads, as they are now."""
        return self._adam.snapshot()

    def describe(self):
        return f"C++ {type(self._optimizer).__name__} ({chosen_isa()})"


class TorchStepper:
    fast = False

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def step(self, storage, items, outs, scale, threads=0):
        masters = storage.master_params  # torch steps on its own threads
        for i, g in items:
            grad = g.to(torch.float32, copy=True)
            if scale != 1.0:
                grad.mul_(scale)
            masters[i].grad = grad
        self._optimizer.step()
        with torch.no_grad():
            for i, _ in items:
                outs[i].copy_(masters[i])
                masters[i].grad = None  # the fp32 copy lives only for the step

    def describe(self):
        return f"torch {type(self._optimizer).__name__}.step()"


def make_stepper(optimizer, log):
    reason = not_covered_reason(optimizer)
    if reason is None:
        return FastStepper(optimizer)
    log(f"offload: {reason}; torch's {type(optimizer).__name__}.step() steps the host shards "
        "(fp32 copies of the gradients, one extra pass each way)")
    return TorchStepper(optimizer)
