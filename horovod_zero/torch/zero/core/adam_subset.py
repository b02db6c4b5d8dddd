"""Torch's own Adam/AdamW update of some parameters of one param group, as
optimizer.step() would make it: the group's kernel (fused, foreach or single-tensor),
on the optimizer's own state, made by its own _init_group, so that checkpoints and
results are those of optimizer.step(). Adam's update is elementwise, so stepping a
group's parameters in several calls gives the same values as one call. Used where ZeRO
steps shards piecewise: during backward (core/early_step.py) and in chunks at step()
(core/step_chunks.py)."""

import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam

STEPPABLE = (torch.optim.Adam, torch.optim.AdamW)


def steps_piecewise(optimizer):
    """Whether adam_step() can stand in for this optimizer's step(): exactly Adam or
    AdamW (a subclass may step differently), no differentiable group (the piecewise step
    runs without autograd) and no step pre-hook (one may change what the step does
    before it starts)."""
    if type(optimizer) not in STEPPABLE or any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    return not optimizer._optimizer_step_pre_hooks and not torch_optimizer._global_optimizer_pre_hooks


def adam_step(optimizer, group, params, hyper=None):
    """Steps `params` (parameters of `group` whose .grad is set) as optimizer.step()
    would. `hyper`: hyper.hyper_of() values to use instead of the group's current ones
    (a step inside backward uses those backward began with)."""
    lists = [], [], [], [], [], []
    has_complex = optimizer._init_group(dict(group, params=params), *lists)
    if hyper is None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay, decoupled, maximize = group["weight_decay"], group["decoupled_weight_decay"], group["maximize"]
    else:
        lr, beta1, beta2, eps, weight_decay, decoupled, maximize = hyper
    adam(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=lr,
         weight_decay=weight_decay, eps=eps, maximize=maximize, foreach=group["foreach"],
         capturable=group["capturable"], differentiable=False, fused=group["fused"],
         decoupled_weight_decay=decoupled)
