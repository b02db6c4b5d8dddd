"""Elastic commits of a DistributedZeroOptimizer (hvd.elastic.TorchState): each rank keeps
its shards in host memory and a copy of another rank's, so that a job that lost ranks
rebuilds every shard from the survivors and reshards it for its new size, with no disk.

[Note: buddies]
Rank r's copy goes to its buddy: the first rank after r on another node (the next rank when
every rank is on one node), so that a lost node takes no shard's both copies. The copies
travel in one alltoall per kind of state at each commit, over NCCL when the shards are on
GPUs. A rank's shards are, per parameter, its elements
[r * n, (r + 1) * n) (core/plan.py) of the fp32 master and of each parameter-shaped
optimizer state (Adam's two moments); state that is not (Adam's step) is the same on every
rank and kept with the step count, the loss scaler, the hyperparameters and the model's
other tensors (buffers, frozen parameters). Host memory: twice this rank's shard state.

[Note: resharding from the survivors]
After a reset, the survivors say which committed ranks they hold. Each committed rank gets
one provider: itself if it survived, else a survivor holding its copy; a rank with neither
makes every rank raise, naming it. Rank j of the new job needs [j * n', (j + 1) * n') of
each parameter, and a provider sends it the overlap of what it holds: one alltoall per kind
of state, in an order both sides derive from the layout (by source rank, committed rank,
parameter). A committed job and a new one of any sizes, either way."""

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from horovod_zero.torch.alltoall import alltoall
from horovod_zero.torch.basics import local_rank, rank, size
from horovod_zero.torch.objects import allgather_object, broadcast_object


@dataclass(frozen=True)
class Layout:
    """What a commit holds: the committed job's size, each parameter's element count, and
    per kind of state its dtype and the parameters (shard indices) that have it."""
    size: int
    numels: Tuple[int, ...]
    kinds: Tuple[Tuple[str, torch.dtype, Tuple[int, ...]], ...]  # "master" first


def _range(numel, n_ranks, r):
    shard = -(-numel // n_ranks)
    lo = min(r * shard, numel)
    return lo, min(lo + shard, numel)


def _lengths(layout, r, indices):
    """Committed rank r's element count of each parameter at `indices`."""
    return [hi - lo for lo, hi in (_range(layout.numels[i], layout.size, r) for i in indices)]


class Commit:
    """One commit on this rank: `held[r][kind]` is committed rank r's elements of that kind,
    its parameters' ranges one after another (this rank's own, and those it keeps a copy of)."""

    def __init__(self, number, old_rank, layout, held, objects):
        self.number = number
        self.old_rank = old_rank
        self.layout = layout
        self.held: Dict[int, Dict[str, torch.Tensor]] = held
        self.objects = objects

    def summary(self):
        return {"number": self.number, "rank": self.old_rank, "held": sorted(self.held), "layout": self.layout}


def _state_of(view):
    """(layout kinds, {(kind, index): flat local tensor}, scalar state per index)."""
    masters = view.masters
    kinds = {"master": (torch.float32, [s.index for s in view.shards])}
    tensors = {("master", s.index): m.detach() for s, m in zip(view.shards, masters)}
    scalars = {}
    for s, mp in zip(view.shards, masters):
        for k, v in view.inner.state.get(mp, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == mp.shape:
                kinds.setdefault(k, (v.dtype, []))[1].append(s.index)
                tensors[(k, s.index)] = v.detach()
            else:
                scalars.setdefault(s.index, {})[k] = v.detach().clone() if torch.is_tensor(v) else v  # its device kept
    return tuple((k, d, tuple(ix)) for k, (d, ix) in kinds.items()), tensors, scalars


def _others(model, view):
    """The model's state_dict entries the optimizer does not train (buffers, frozen parameters)."""
    if model is None:
        return {}
    trained = {id(p) for p in view.params}
    return {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict(keep_vars=True).items()
            if id(t) not in trained}


def _buddy(r, nodes):
    n = len(nodes)
    for step in range(1, n):
        q = (r + step) % n
        if nodes[q] != nodes[r]:
            return q
    return (r + 1) % n


def take(view, model, number) -> Commit:
    """Commits this rank's shards and sends their copy to its buddy (collective). Ranks are
    the optimizer's places among the ranks that split each parameter (view.rank): with hybrid
    sharding each node holds every shard already, and no copy is sent."""
    with view.materialized():
        kinds, tensors, scalars = _state_of(view)
        layout = Layout(view.size, tuple(s.numel for s in view.shards), kinds)
        # Gathered where the state lives: on a GPU the copy to the buddy goes over NCCL, and
        # only then does the commit move to host memory.
        device = view.masters[0].device if view.masters else torch.device("cpu")
        mine = {}
        for kind, dtype, indices in kinds:
            parts = [tensors[(kind, i)][:n] for i, n in zip(indices, _lengths(layout, view.rank, indices))]
            mine[kind] = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    scaler = view.loss_scaler
    objects = {"scalars": scalars, "groups": [{k: v for k, v in g.items() if k != "params"}
                                              for g in view.inner.param_groups],
               "step_count": view.step_count, "loss_scaler": scaler.state_dict() if scaler else None,
               "others": _others(model, view)}
    held = {view.rank: mine}
    if size() > 1 and view.size == size():
        # A node's first rank names the node: launchers place a node's ranks one after another.
        nodes = allgather_object(rank() - local_rank(), name=f"zero.elastic.nodes.{number}")
        buddy = _buddy(rank(), nodes)
        for kind, dtype, indices in kinds:  # one alltoall per kind: each stays below 2**31 elements longer
            splits = torch.zeros(size(), dtype=torch.int64)  # int64 counts back, too
            splits[buddy] = mine[kind].numel()
            received, counts = alltoall(mine[kind], splits=splits, name=f"zero.elastic.commit.{number}.{kind}")
            at = 0
            for src, count in enumerate(counts.tolist()):
                if count:
                    chunk = received[at:at + count]
                    held.setdefault(src, {})[kind] = chunk.cpu() if chunk.is_cuda else chunk.clone()
                    at += count
    held[view.rank] = {k: t.cpu() if t.is_cuda else t for k, t in mine.items()}
    return Commit(number, view.rank, layout, held, objects)


def restore(commit, view, model):
    """Loads the last commit into this job's shards, whatever its size, and publishes the
    parameters (collective). Returns its number, or None when no rank holds a commit (the
    job's start: nothing to load)."""
    everyone = allgather_object((commit.summary() if commit is not None else None, view.rank),
                                name="zero.elastic.restore")
    places = [place for _, place in everyone]  # each rank's place in this job's sharding
    holders = [(q, s) for q, (s, _) in enumerate(everyone) if s is not None]
    if not holders:
        return None
    numbers = sorted({s["number"] for _, s in holders})
    if len(numbers) > 1:
        raise RuntimeError(f"The ranks hold different commits ({numbers}): a failure interrupted a commit. The state "
                           "cannot be rebuilt from memory; restart from a checkpoint (hvd.zero.load_checkpoint).")
    layout = holders[0][1]["layout"]
    provider = {}
    for q, s in holders:
        for r in s["held"]:
            provider.setdefault(r, q)
    for q, s in holders:
        provider[s["rank"]] = q  # a survivor provides its own shards
    lost = [r for r in range(layout.size) if r not in provider]
    if lost:
        raise RuntimeError(
            f"The committed shards of ranks {lost} of the previous job's {layout.size} are lost: those ranks and the "
            "ranks that kept their copies failed before the next commit. The state cannot be rebuilt from memory; "
            "restart from a checkpoint (hvd.zero.save_checkpoint / load_checkpoint).")
    if tuple(s.numel for s in view.shards) != layout.numels:
        raise RuntimeError("The commit is of another model: its parameters' sizes differ from this optimizer's.")
    with view.materialized(write_back=True):
        targets = _targets(view, layout)
        for kind, dtype, indices in layout.kinds:
            _exchange(kind, dtype, indices, layout, commit, provider, places, view.size, targets)
        objects = broadcast_object(commit.objects if holders[0][0] == rank() else None, root_rank=holders[0][0],
                                   name="zero.elastic.objects")
        _load_objects(view, model, objects)
        view.publish()  # inside: with NVMe offload the masters are in memory only here
    return numbers[0]


def _targets(view, layout):
    """(kind, index) -> this rank's flat shard to write: the master, or new optimizer state."""
    out = {}
    for s, m in zip(view.shards, view.masters):
        out[("master", s.index)] = m.data
    for kind, dtype, indices in layout.kinds[1:]:
        for i in indices:
            mp = view.masters[i]
            t = torch.zeros(mp.shape, dtype=dtype, device=mp.device)
            view.inner.state.setdefault(mp, {})[kind] = t
            out[(kind, i)] = t
    return out


def _overlaps(layout, r, indices, new_size, j):
    """(index, offset in r's committed elements, offset in j's new shard, count) of each overlap."""
    out, at = [], 0
    for i in indices:
        lo, hi = _range(layout.numels[i], layout.size, r)
        nlo, nhi = _range(layout.numels[i], new_size, j)
        a, b = max(lo, nlo), min(hi, nhi)
        if a < b:
            out.append((i, at + a - lo, a - nlo, b - a))
        at += hi - lo
    return out


def _exchange(kind, dtype, indices, layout, commit, provider, places, new_size, targets):
    """One alltoall: every rank gets, from the providers, its new shard of each parameter of
    this kind. `places[g]`: rank g's place in the new sharding."""
    me = rank()
    mine = sorted(r for r, q in provider.items() if q == me)
    parts, splits = [], []
    for j in places:
        count = 0
        for r in mine:
            src = commit.held[r][kind]
            for _, at, _, n in _overlaps(layout, r, indices, new_size, j):
                parts.append(src[at:at + n])
                count += n
        splits.append(count)
    send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    device = next(iter(targets.values())).device
    if device.type == "cuda":
        send = send.to(device)  # NCCL carries it, and it lands where the shards are
    received, _ = alltoall(send, splits=torch.tensor(splits, dtype=torch.int64), name=f"zero.elastic.reshard.{kind}")
    at = 0
    for q in range(len(places)):
        for r in sorted(r for r, p in provider.items() if p == q):
            for i, _, dst, n in _overlaps(layout, r, indices, new_size, places[me]):
                targets[(kind, i)][dst:dst + n].copy_(received[at:at + n])
                at += n


def _load_objects(view, model, objects):
    for group, saved in zip(view.inner.param_groups, objects["groups"]):
        group.update(saved)
    for s, mp in zip(view.shards, view.masters):
        for k, v in objects["scalars"].get(s.index, {}).items():
            view.inner.state.setdefault(mp, {})[k] = v.clone() if torch.is_tensor(v) else v
    if view.loss_scaler is not None and objects["loss_scaler"]:
        view.loss_scaler.load_state_dict(objects["loss_scaler"])
    view.set_step_count(objects["step_count"])
    if model is not None and objects["others"]:
        current = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for k, v in objects["others"].items():
                current[k].data.copy_(v)
