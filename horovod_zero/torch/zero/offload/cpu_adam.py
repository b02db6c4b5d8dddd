"""The C++ CPU Adam (csrc/offload/cpu_adam.h, threaded by python/offload_adam.cc)
for ZeRO offload: one pass per shard reads the fp32 param and moments and a
fp32/bf16/fp16 gradient, and writes them back with an optional bf16/fp16/fp32
copy of the new param for the GPU.

CpuAdam steps a torch.optim.Adam or AdamW in its place, keeping the optimizer's
state exactly as torch keeps it ('step' a 0-dim tensor, fp32 'exp_avg' and
'exp_avg_sq'), so that state_dict()/load_state_dict() and torch's own step()
work on the same optimizer before, after or between its steps. The results are
torch's default (single-tensor) step to fp32 rounding ([Note: CPU Adam
numerics] in cpu_adam.h). adam_step_flat is the same step on bare tensors, for
state that does not live in an optimizer (staged from NVMe).

HOROVOD_ZERO_CPU_ADAM_ISA (horovod_zero/settings.py) forces an instruction set.
"""

from typing import Iterable, Mapping, Optional, Tuple

import torch

from horovod_zero import _core, settings
from horovod_zero.torch.zero.core.hyper import hyper_of, snapshot

_COVERED = (torch.optim.Adam, torch.optim.AdamW)
_UNCOVERED_FLAGS = ("amsgrad", "capturable", "differentiable")


def chosen_isa(env: Optional[Mapping[str, str]] = None) -> str:
    """The instruction set the step uses (avx512, avx2 or scalar): the widest this
    CPU has, or the one HOROVOD_ZERO_CPU_ADAM_ISA names."""
    requested = settings.read_section("cpu_adam", env)["cpu_adam_isa"]
    try:
        return _core.cpu_adam_isa(requested)
    except ValueError as e:
        raise ValueError(f"HOROVOD_ZERO_CPU_ADAM_ISA={requested!r}: {e}") from None


def _group_reason(group) -> Optional[str]:
    for flag in _UNCOVERED_FLAGS:
        if group.get(flag):
            return f"with {flag}=True"
    if any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return "with betas given as tensors"
    if isinstance(group["weight_decay"], torch.Tensor) or isinstance(group["eps"], torch.Tensor):
        return "with weight_decay or eps given as a tensor"
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        return "with a tensor lr of more than one element"
    return None


def not_covered_reason(optimizer) -> Optional[str]:
    """None when CpuAdam can step `optimizer` (a torch.optim.Adam or AdamW, not a
    subclass, whose options the kernel covers); else why not, in a few words."""
    cls = type(optimizer)
    if cls not in _COVERED:
        return f"{cls.__name__} is not covered by the C++ CPU Adam (only torch.optim.Adam and AdamW are)"
    for i, group in enumerate(optimizer.param_groups):
        reason = _group_reason(group)
        if reason is not None:
            return f"{cls.__name__} {reason} (param group {i}) is not covered by the C++ CPU Adam"
    return None


def adam_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   out: Optional[torch.Tensor], *, lr: float, betas: Tuple[float, float], eps: float,
                   weight_decay: float, step: int, decoupled: bool, maximize: bool = False, grad_scale: float = 1.0,
                   isa: Optional[str] = None, threads: int = 0) -> None:
    """One Adam (decoupled=False: L2, grad += weight_decay * param) or AdamW step in
    place on contiguous CPU tensors of equal numel: fp32 param, exp_avg and
    exp_avg_sq; grad fp32, bf16 or fp16, used as grad * grad_scale; `out` (None,
    or fp32/bf16/fp16) receives the new param. `step` is the step being taken,
    from 1. `isa`: None for chosen_isa(). `threads`: 0 for torch's intra-op threads."""
    _core.cpu_adam_step(param, grad, exp_avg, exp_avg_sq, out, float(lr), float(betas[0]), float(betas[1]), float(eps),
                        float(weight_decay), int(step), bool(decoupled), bool(maximize), float(grad_scale),
                        isa or chosen_isa(), int(threads))


def _step_dtype(group) -> torch.dtype:
    # torch/optim/optimizer.py: _get_scalar_dtype
    if group.get("fused") or torch.get_default_dtype() != torch.float64:
        return torch.float32
    return torch.float64


def _state(optimizer, group, param: torch.Tensor) -> dict:
    """param's state, created on first use as torch.optim.Adam._init_group creates it."""
    state = optimizer.state[param]
    if len(state) == 0:
        state["step"] = (torch.zeros((), dtype=_step_dtype(group), device=param.device) if group.get("fused")
                         else torch.tensor(0.0, dtype=_step_dtype(group)))
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    elif not torch.is_tensor(state["step"]):  # as Adam.__setstate__ converts an old checkpoint's number
        state["step"] = torch.tensor(float(state["step"]), dtype=_step_dtype(group))
    return state


class CpuAdam:
    """Steps `optimizer` (a torch.optim.Adam or AdamW: see not_covered_reason) with
    the C++ CPU Adam, on the items it is given."""

    def __init__(self, optimizer, env: Optional[Mapping[str, str]] = None):
        reason = not_covered_reason(optimizer)
        if reason is not None:
            raise ValueError(reason + "; step it with torch (check not_covered_reason() before building CpuAdam).")
        self.optimizer = optimizer
        self.isa = chosen_isa(env)

    def snapshot(self) -> dict:
        """Each param group's hyper_of(), by id(group): what step_items(hyper=) takes."""
        return snapshot(self.optimizer.param_groups)

    def step_items(self, items: Iterable[Tuple[dict, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]], *,
                   grad_scale: float = 1.0, threads: int = 0, hyper: Optional[dict] = None) -> None:
        """One step of each item (group, param, grad, out): `group` is the param
        group holding `param` (an fp32 CPU tensor), `grad` a CPU tensor of its numel
        in fp32/bf16/fp16, used as grad * grad_scale; `out` None or a CPU tensor of
        its numel in bf16/fp16/fp32 that receives the new param. `threads`: 0 for
        torch's intra-op threads. `hyper`: a snapshot() to step with instead of the
        groups' values now (a step that runs after its caller moved on)."""
        owner = {id(p): id(g) for g in self.optimizer.param_groups for p in g["params"]}
        batch = []
        for group, param, grad, out in items:
            if owner.get(id(param)) != id(group):
                raise ValueError("CpuAdam.step_items: an item's param is not in the param group given with it; pass "
                                 "the optimizer.param_groups entry that holds the param.")
            if grad is None:
                raise ValueError("CpuAdam.step_items: an item has no gradient; leave such params out.")
            reason = _group_reason(group)  # a group added after CpuAdam was built
            if reason is not None:
                raise ValueError(f"{type(self.optimizer).__name__} {reason} is not covered by the C++ CPU Adam.")
            state = _state(self.optimizer, group, param)
            # A group added after the snapshot (add_param_group between backward passes) steps as it is.
            lr, b1, b2, eps, wd, decoupled, maximize = (hyper or {}).get(id(group)) or hyper_of(group)
            batch.append((param.detach(), grad, state["exp_avg"], state["exp_avg_sq"], out, lr, b1, b2, eps, wd,
                          state["step"], decoupled, maximize, float(grad_scale)))
        # One call: the GIL is released once for all of them, and each state["step"] is
        # incremented there, after every item was checked and stepped.
        _core.cpu_adam_step_batch(batch, self.isa, int(threads))
