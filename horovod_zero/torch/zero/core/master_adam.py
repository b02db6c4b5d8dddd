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
    also written, rounded as the gather's cast rounds. Checked before any state changes,
    so a refusal leaves the step counts as they were."""
    for p, g in zip(params, grads):
        if g.device != p.device or g.numel() != p.numel() or not g.is_contiguous() \
                or g.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"master_adam: a gradient ({g.dtype}, {tuple(g.shape)} on {g.device}) does not fit its "
                             f"master shard ({p.numel()} elements on {p.device}); set HOROVOD_ZERO_MASTER_ADAM=0.")
    for p, c in zip(params, copies or []):
        if c.device != p.device or c.numel() != p.numel() or not c.is_contiguous() \
                or c.dtype not in (torch.bfloat16, torch.float16) or c.dtype != copies[0].dtype:
            raise ValueError(f"master_adam: a copy ({c.dtype}, {tuple(c.shape)} on {c.device}) does not fit its "
                             f"master shard ({p.numel()} elements on {p.device}).")
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
    by_dtype = {}
    for p, g, c in zip(params, grads, copies if copies is not None else [None] * len(params)):
        by_dtype.setdefault(g.dtype, []).append((p, g, c))
    beta1, beta2 = group["betas"]
    for pairs in by_dtype.values():
        ps = [p for p, _, _ in pairs]
        steps = [state[p]["step"] for p in ps]
        torch._foreach_add_(steps, 1)  # as torch's fused Adam does before its kernel
        _core.master_adam_step([p.detach() for p in ps], [g for _, g, _ in pairs], [state[p]["exp_avg"] for p in ps],
                               [state[p]["exp_avg_sq"] for p in ps], steps, lr=float(group["lr"]),
                               beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                               weight_decay=float(group["weight_decay"]),
                               decoupled=bool(group["decoupled_weight_decay"]), maximize=bool(group["maximize"]),
                               grad_scale=float(grad_scale),
                               copies=[c for _, _, c in pairs] if copies is not None else [])
