"""Helpers built on the collectives: parameters and Python objects from a root rank.
Each takes process_set= (default: every rank); root_rank is always a rank of the
job (hvd.rank()), one of the set's."""

import torch

from horovod_zero.torch.basics import rank
from horovod_zero.torch.mpi_ops import broadcast_async_, synchronize
from horovod_zero.torch.objects import allgather_object, broadcast_object  # noqa: F401 - hvd.broadcast_object
from horovod_zero.torch.process_sets import _world_rank, global_process_set
from horovod_zero.torch.zero import DistributedZeroOptimizer
from horovod_zero.torch.zero.state import full_state


def broadcast_parameters(params, root_rank=0, process_set=global_process_set):
    """Overwrites every rank's parameters (of process_set's ranks) with root_rank's.
    `params` is a state_dict or an iterable of (name, tensor) such as
    model.named_parameters()."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            raise ValueError("broadcast_parameters takes a state_dict or named_parameters(), not bare tensors.")
    handles, copies = [], []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        target = t if t.is_contiguous() else t.contiguous()
        handles.append(broadcast_async_(target, root_rank, name=f"broadcast_parameters.{name}",
                                        process_set=process_set))
        if target is not t:
            copies.append((t, target))
    for h in handles:
        synchronize(h)
    with torch.no_grad():
        for t, target in copies:
            t.copy_(target)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state and hyperparameters root_rank's: the state of
    each parameter (tensors such as momentum buffers, and values such as a step
    count) and every param group's settings (lr, betas, ...). Parameters are matched
    by their position in param_groups, as in state_dict(). Works on torch.optim
    optimizers, hvd.DistributedOptimizer and hvd.DistributedZeroOptimizer; call it on
    every rank (of process_set).

    Unlike Horovod's, it takes no optimizer step to create missing state: a rank
    receives the state root has (none if root has none). A rank whose optimizer held
    no state is left, as Horovod's dummy step leaves it, with a zero gradient for each
    parameter that requires one (sparse for torch.optim.SparseAdam, and for the sparse
    nn.Embedding parameters of `model`), so that after the broadcast of an optimizer
    that never stepped every rank has the same gradients.

    A DistributedZeroOptimizer's state is sharded. The root gives the full optimizer
    state it loaded with opt.load_state_dict() (a torch optimizer's state_dict(), or
    the 'optimizer' of hvd.zero.consolidated_state_dict), every rank taking its shard
    of it; without one, its hyperparameters, after checking that every rank's sharded
    state is at the same step (zero/state/full_state.py)."""
    if isinstance(optimizer, DistributedZeroOptimizer):
        return full_state.broadcast(optimizer.sharded_state, root_rank, process_set)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    shape = (len(optimizer.param_groups), len(params))
    # Every rank says how many groups and parameters it has; root adds its layout.
    everyone = allgather_object((shape, _state_layout(optimizer, params) if rank() == root_rank else None),
                                name="broadcast_optimizer_state", process_set=process_set)
    root_at = [k for k, (_, layout) in enumerate(everyone) if layout is not None]
    if len(root_at) != 1:
        raise ValueError(f"root_rank {root_rank} is not one of the ranks that called broadcast_optimizer_state() "
                         f"(on {process_set}): pass the rank (hvd.rank()) of one of them.")
    root_shape, layout = everyone[root_at[0]]
    differ = [k for k, (s, _) in enumerate(everyone) if s != root_shape]
    if differ:
        raise ValueError(
            f"Rank {root_rank}'s optimizer has {root_shape[0]} param groups and {root_shape[1]} parameters, but "
            f"ranks {[_world_rank(process_set, k) for k in differ]} have {[everyone[k][0] for k in differ]}: build "
            "the same optimizer over the same model on every rank.")
    received = {}
    for i, (p, entries) in enumerate(zip(params, layout["state"])):
        mine = optimizer.state.get(p, {})
        for key, spec in entries.items():
            if isinstance(spec, _TensorSpec):
                t = mine[key].contiguous() if rank() == root_rank else _receiver(mine.get(key), spec, p)
                received[i, key] = (t, broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}.{key}",
                                                        process_set=process_set))
    synchronize([h for _, h in received.values()])
    if not any(optimizer.state.get(p) for p in params):  # before the root's state lands here
        _zero_grads(optimizer, params, model)
    if rank() == root_rank:
        return
    for group, settings in zip(optimizer.param_groups, layout["groups"]):
        group.update(settings)
    for i, (p, entries) in enumerate(zip(params, layout["state"])):
        if entries:
            optimizer.state[p] = {k: received[i, k][0] if isinstance(v, _TensorSpec) else v for k, v in entries.items()}
        else:
            optimizer.state.pop(p, None)


def _zero_grads(optimizer, params, model):
    """What Horovod's dummy step leaves on a rank whose optimizer held no state: a zero
    gradient for each parameter that requires one, sparse where the optimizer or `model`
    takes sparse gradients."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a DistributedOptimizer's torch optimizer
    sparse = set()
    if model is not None:
        sparse = {p for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
                  for p in m.parameters()}
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
            if isinstance(inner, torch.optim.SparseAdam) or p in sparse:
                p.grad = p.grad.to_sparse()


class _TensorSpec:
    """A state tensor in the layout root sends: what a receiver allocates."""

    def __init__(self, t, p):
        self.shape, self.dtype = tuple(t.shape), t.dtype
        self.with_param = t.device == p.device  # else on the CPU (e.g. Adam's step count)


def _state_layout(optimizer, params):
    """Root's param group settings, and per parameter its state, with a _TensorSpec
    in place of each tensor (the tensors themselves go by broadcast)."""
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "state": [{k: _TensorSpec(v, p) if isinstance(v, torch.Tensor) else v
                   for k, v in optimizer.state.get(p, {}).items()} for p in params],
    }


def _receiver(t, spec, p):
    """This rank's tensor to receive root's into: its own when it fits, else a new one."""
    device = p.device if spec.with_param else torch.device("cpu")
    if (isinstance(t, torch.Tensor) and tuple(t.shape) == spec.shape and t.dtype == spec.dtype
            and t.device == device and t.is_contiguous()):
        return t
    return torch.empty(spec.shape, dtype=spec.dtype, device=device)
