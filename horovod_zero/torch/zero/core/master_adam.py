"""Adam/AdamW on fp32 master shards straight from their reduced bf16/fp16 gradients, on
CUDA (csrc/cuda/master_adam.cu): torch's fused kernel needs fp32 gradients, so a cast
kernel (read 2, write 4 bytes per element) ran before it, and the step read the 4 bytes
again. This kernel reads the 2 bytes once: 26 bytes per element moved instead of 34,
at the HBM bound. The update is torch's fused Adam's, in fp32: results agree with it to
fp32 rounding, not bit for bit. Used for groups that step with torch's fused kernel
(fused=True, which ZeRO sets where foreach was left unset: core/fused.py), without
amsgrad or capturable, with a float lr (HOROVOD_ZERO_MASTER_ADAM=0: torch's kernel)."""

import torch

from horovod_zero import _core


def available(device):
    return device.type == "cuda" and getattr(_core, "HAVE_MASTER_ADAM", False)


def fits(group):
    """Whether this group's step is the one the kernel makes: torch's fused Adam/AdamW."""
    return bool(group.get("fused")) and not group.get("amsgrad") and not group.get("capturable") \
        and not group.get("differentiable") and not torch.is_tensor(group["lr"])


def step(optimizer, group, params, grads, grad_scale=1.0, copies=None):
    """Steps `params` (masters of `group`, .grad None) with `grads` (their reduced
    gradients) times `grad_scale`, on the optimizer's own state: one launch per gradient
    dtype. `copies` (one bf16/fp16 tensor per param, or None): where each new value is
    also written, rounded as the gather's cast rounds. The kernel's binding checks every
    tensor before it adds 1 to the step counts, so a refusal leaves them as they were;
    the checks are there, not here, because this runs for every shard at each step."""
    state = optimizer.state
    fresh = [p for p in params if not state.get(p)]
    if fresh:  # the state made by the optimizer's own _init_group, as its step would make it
        for p in fresh:
            p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
        try:
            optimizer._init_group(dict(group, params=fresh), [], [], [], [], [], [])
        finally:
            for p in fresh:
                p.grad = None
    beta1, beta2 = group["betas"]
    hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                 weight_decay=float(group["weight_decay"]), decoupled=bool(group["decoupled_weight_decay"]),
                 maximize=bool(group["maximize"]), grad_scale=float(grad_scale))
    for dtype in dict.fromkeys(g.dtype for g in grads):  # one launch per gradient dtype, in order
        ks = [k for k, g in enumerate(grads) if g.dtype == dtype]
        states = [state[params[k]] for k in ks]
        try:
            _core.master_adam_step([params[k] for k in ks], [grads[k] for k in ks], [s["exp_avg"] for s in states],
                                   [s["exp_avg_sq"] for s in states], [s["step"] for s in states], **hyper,
                                   copies=[copies[k] for k in ks] if copies is not None else [], add_step=True)
        except ValueError as e:
            raise ValueError(f"{e} A master shard, its gradient and its state must match; "
                             "HOROVOD_ZERO_MASTER_ADAM=0 steps with torch's kernel instead.") from None
