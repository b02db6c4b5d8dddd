"""A full (unsharded) optimizer state given to a DistributedZeroOptimizer, Horovod's way:
rank 0 loads a checkpoint, then hvd.broadcast_optimizer_state() gives it to every rank.

- opt.load_state_dict(full) takes torch's optimizer state dict (parameters by position,
  as a plain optimizer or hvd.DistributedOptimizer saves it) or the "optimizer" entry of
  hvd.zero.consolidated_state_dict (parameters by name). It is local: this rank loads its
  own shard of that state at once, and keeps the full state for a broadcast to come.
- broadcast(view, root) then gives every rank the root's state: the full state the root
  loaded, each rank cutting its own shard from it (consolidated.py's loader), or else the
  root's hyperparameters only, after checking that every rank is at the same point. A
  ZeRO optimizer's own state (stepped, or loaded on every rank from its rank's shards or a
  checkpoint) is sharded: each rank already holds its part of it, and the root holds
  only its own, so there is nothing more of it the root could give.
- At stages 1 and 2 the model's parameters are whole on every rank, and the fp32 masters
  the optimizer steps are copies of them. Where the root's parameters no longer hold its
  masters' values (rank 0 loaded weights into the model after wrapping, the idiom's other
  half), the broadcast takes the root's parameters as the new masters on every rank, as
  it takes the root's optimizer state; where only other ranks' parameters changed, they
  take the masters' values again.
"""

import torch

from horovod_zero.torch import basics
from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.objects import allgather_object
from horovod_zero.torch.zero.core import fused
from horovod_zero.torch.zero.hybrid import Scope
from horovod_zero.torch.zero.state import compat, consolidated

# How the inner optimizer steps its shards, which ZeRO chose (core/fused.py): a loaded
# state's settings for the full parameters do not replace it.
_KERNEL = ("fused", "foreach")


def is_rank_shard(state):
    """Whether `state` is what a DistributedZeroOptimizer's state_dict() returns (one rank's shard)."""
    return isinstance(state, dict) and "zero" in state and "master" in state


def normalize(view, state):
    """`state` as {"state": {name: {key: value}}, "param_groups": [...]} with this optimizer's
    parameter names and its group order. Raises ValueError, naming what differs, where it
    does not fit this optimizer."""
    if not isinstance(state, dict) or not {"state", "param_groups"} <= state.keys():
        found = sorted(map(str, state.keys())) if isinstance(state, dict) else type(state).__name__
        hint = (" It is a consolidated checkpoint: load it on every rank with hvd.zero.load_consolidated(state, "
                "model, opt), or pass its 'optimizer' entry." if isinstance(state, dict) and "optimizer" in state
                else "")
        raise ValueError(f"load_state_dict() takes this rank's state_dict() of a DistributedZeroOptimizer, or a "
                         f"full optimizer state (a torch optimizer's state_dict(), or the 'optimizer' of "
                         f"hvd.zero.consolidated_state_dict); this has {found}.{hint}")
    plan, groups = view.groups, state["param_groups"]
    ids = [p for g in groups for p in g["params"]]
    if all(isinstance(p, int) for p in ids):
        # torch's: parameters by position, matched as torch.optim.Optimizer.load_state_dict matches them.
        sizes, mine = [len(g["params"]) for g in groups], [len(gs) for gs in plan]
        if sizes != mine:
            raise ValueError(f"The optimizer state has param groups of {sizes} parameters; this optimizer's hold "
                             f"{mine}. Build the optimizer over the same parameters, in the same groups and order, "
                             "as the one that saved it.")
        name_of = {pid: s.name for g, gs in zip(groups, plan) for pid, s in zip(g["params"], gs)}
        unknown = sorted(set(state["state"]) - set(name_of), key=str)
        if unknown:
            raise ValueError(f"The optimizer state has state for parameters {unknown[:5]} that its param groups do "
                             "not list: it is not a whole optimizer state_dict().")
        by_name = {name_of[k]: v for k, v in state["state"].items()}
        groups = [dict(g, params=[name_of[p] for p in g["params"]]) for g in groups]
        saved = {"class": None, "named": view.named, "groups": [list(g["params"]) for g in groups], "shapes": None}
    elif all(isinstance(p, str) for p in ids):
        by_name = state["state"]
        named = not all(n.startswith("param.") for n in ids)
        saved = {"class": None, "named": named, "groups": [list(g["params"]) for g in groups], "shapes": None}
    else:
        raise ValueError("The optimizer state's param groups list their parameters neither by position (a torch "
                         "optimizer's state_dict()) nor by name (hvd.zero.consolidated_state_dict).")
    compat.check_class(saved, groups, by_name, view.inner)
    order = compat.match_groups(saved, plan)
    numel = {s.name: s.numel for s in view.shards}
    for name, entry in by_name.items():
        if name not in numel:
            raise ValueError(f"The optimizer state has state for parameter {name!r}, which this optimizer does not "
                             "train.")
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() != numel[name]:
                raise ValueError(f"The optimizer state's {key!r} of parameter {name!r} has shape "
                                 f"{tuple(value.shape)}; the parameter has {numel[name]} elements. Only state "
                                 "shaped like its parameter (or a scalar) can be sharded.")
    return {"state": by_name, "param_groups": [groups[i] for i in order]}


def load(view, state):
    """opt.load_state_dict(full): this rank's shard of a full optimizer state, at once and
    without collectives; the state is kept for hvd.broadcast_optimizer_state()."""
    full = normalize(view, state)
    _load_shards(view, full)
    view.loaded_full = (full, view.step_count)


def _load_shards(view, full):
    with view.materialized(write_back=True):
        consolidated.load_optimizer_shards(view, full, range(len(view.groups)), keep=_KERNEL)
        fused.place_steps(view.inner)  # a fused group's `step` where its kernel reads it


def _pending(view):
    """The full state this rank loaded and has not stepped since, or None."""
    loaded = view.loaded_full
    if loaded is None or loaded[1] != view.step_count:
        return None
    return loaded[0]


def _changed_params(view):
    """Stages 1 and 2: whether a parameter no longer holds this rank's master shard, cast
    to its dtype (so after a step or at wrapping). Call it inside view.materialized()."""
    if view.stage == 3:
        return False
    with torch.no_grad():
        for s, p, mp in zip(view.shards, view.params, view.masters):
            lo, hi = s.my_range(view.rank)
            if hi > lo and not torch.equal(p.detach().reshape(-1)[lo:hi],
                                           mp.detach()[:hi - lo].to(device=p.device, dtype=p.dtype)):
                return True
    return False


def _scope_ranks(scope):
    return list(scope.process_set.ranks) if scope.process_set is not None else list(range(basics.size()))


def broadcast(view, root_rank, process_set=None):
    """hvd.broadcast_optimizer_state() of a DistributedZeroOptimizer; every rank of the
    optimizer calls it."""
    scope = view.scope
    if process_set is not None and process_set.process_set_id not in (0, getattr(scope.process_set,
                                                                                 "process_set_id", 0)):
        raise ValueError(f"broadcast_optimizer_state(process_set={process_set}) of a DistributedZeroOptimizer "
                         "built over other ranks: leave process_set out; the optimizer's own ranks take part.")
    ranks = _scope_ranks(scope)
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not one of the optimizer's ranks {ranks}: pass the rank "
                         "(hvd.rank()) of one of them.")
    with view.materialized():
        changed = _changed_params(view)
    inner = view.inner
    mine = {"layout": [[(s.name, tuple(s.shape)) for s in gs] for gs in view.groups],
            "class": type(inner).__name__, "step_count": view.step_count,
            "has_state": any(bool(v) for v in inner.state.values()), "full": _pending(view) is not None,
            "changed": changed}
    if basics.rank() == root_rank:
        mine["hyper"] = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                         for g in inner.param_groups]
    everyone = allgather_object(mine, name="broadcast_optimizer_state.zero", process_set=scope.process_set)
    root = everyone[ranks.index(root_rank)]
    differ = [r for r, e in zip(ranks, everyone) if (e["layout"], e["class"]) != (root["layout"], root["class"])]
    if differ:
        raise ValueError(f"Rank {root_rank}'s DistributedZeroOptimizer ({root['class']}) does not train the same "
                         f"parameters, in the same param groups, as ranks {differ}'s: build the same optimizer "
                         "over the same model on every rank.")
    if not root["full"]:
        _check_agree(ranks, everyone, root_rank, root)
    try:
        _take_params(view, root_rank, root["changed"], any(e["changed"] for e in everyone))
        if root["full"]:
            _give_full(view, root_rank)
        else:
            for group, hyper in zip(inner.param_groups, root["hyper"]):
                group.update(hyper)
    finally:
        view.loaded_full = None


def _check_agree(ranks, everyone, root_rank, root):
    """Without a full state to give, every rank's sharded state must be at the root's point."""
    point = lambda e: (e["step_count"], e["has_state"])  # noqa: E731
    apart = [r for r, e in zip(ranks, everyone) if point(e) != point(root) or e["full"]]
    if not apart:
        return
    said = ", ".join(f"rank {r}: {e['step_count']} steps, " + ("a loaded full state" if e["full"] else
                                                            "state" if e["has_state"] else "no state")
                     for r, e in zip(ranks, everyone) if r in apart or r == root_rank)
    raise ValueError(
        f"broadcast_optimizer_state(root_rank={root_rank}) of a DistributedZeroOptimizer: the root has no full "
        f"optimizer state to give, and the ranks' sharded states differ ({said}). A sharded state cannot be "
        "broadcast: each rank holds its own part. Load a full state on the root first (opt.load_state_dict of a "
        "torch optimizer state_dict, or of hvd.zero.consolidated_state_dict(...)['optimizer']), or load a checkpoint "
        "on every rank (hvd.zero.load_checkpoint).")


def _take_params(view, root_rank, root_changed, any_changed):
    """Stages 1 and 2: the masters follow the root's parameters where they changed there;
    where only other ranks' changed, those take the masters' values again."""
    if not any_changed:
        return
    with view.materialized(write_back=True):
        if root_changed:
            handles = [ops._enqueue_one(ops._core.OP_BROADCAST, p.data, p.data,
                                        f"broadcast_optimizer_state.zero.{s.index}", root=root_rank,
                                        process_set=view.scope.process_set)
                       for s, p in zip(view.shards, view.params) if s.numel > 0]
            ops.synchronize(handles)
            with torch.no_grad():
                for s, p, mp in zip(view.shards, view.params, view.masters):
                    mp.copy_(consolidated.shard_of(p.detach(), s, view.rank, mp.dtype, mp.device))
        view.publish()


def _give_full(view, root_rank):
    """The root's full state, each tensor broadcast on its own; every other rank loads its shards of it."""
    scope = Scope(view.scope.process_set, root_rank)
    full = _pending(view) if scope.is_root() else None
    skeleton, tensors = consolidated._share_structure(full, "the root's optimizer state", scope,
                                                      check=lambda state, source: None)
    full = consolidated._fill(skeleton, tensors, view.device, scope)
    if not scope.is_root():  # the root loaded its own at load_state_dict()
        _load_shards(view, full)
