"""Consolidated checkpoints: full fp32 parameters and optimizer state gathered on
rank 0, loadable into a job of any size.

Rank 0 alone reads and writes the file, so it tells the other ranks whether that
worked before anything else: a missing or corrupt file is an error on every rank
at once, not a hang of the ranks that wait for its data."""

import itertools
import os

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero.state import compat


def _gather_full(t, s, name, process_set):
    """A shard-shaped tensor (this rank's part of parameter `s`) -> the full tensor,
    gathered from the ranks that hold the other shards (`process_set`)."""
    full = ops.synchronize(ops._allgather_async(t.detach().float().contiguous(), name, None, process_set))
    return full[:s.numel].view(s.shape).cpu()


def consolidated_state_dict(model, opt):
    """Full fp32 parameters (and the model's other state) plus the optimizer state,
    on rank 0; None on the other ranks. Every rank must call it."""
    view = opt.sharded_state
    with view.materialized():
        return _consolidated(model, view)


def _consolidated(model, view):
    inner = view.inner
    params, state = {}, {}
    for s, mp in zip(view.shards, view.masters):
        params[s.name] = _gather_full(mp, s, f"zero.ckpt.param.{s.index}", view.shard_set)
        entry = {}
        for key, value in sorted(inner.state.get(mp, {}).items()):
            if torch.is_tensor(value) and value.shape == mp.shape:
                entry[key] = _gather_full(value, s, f"zero.ckpt.state.{s.index}.{key}", view.shard_set)
            else:
                entry[key] = value.cpu() if torch.is_tensor(value) else value
        state[s.name] = entry
    if not view.scope.is_root():
        return None
    others = {}
    if model is not None:
        # A tied parameter's other names hold the same tensor (one storage in the file), so that
        # model.load_state_dict() takes the 'model' entry; stage 3 has no whole value to read there.
        first = {p: s.name for s, p in zip(view.shards, view.params)}
        aliases = {n: params[first[p]] for n, p in model.named_parameters(remove_duplicate=False) if p in first}
        others = {k: aliases.get(k, v).detach().cpu() for k, v in model.state_dict().items() if k not in params}
    groups = []
    for g, group in enumerate(inner.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["params"] = [s.name for s in view.groups[g]]
        groups.append(hyper)
    meta = {"optimizer": compat.describe(inner, view.groups, view.named),
            "loss_scaler": view.loss_scaler.state_dict() if view.loss_scaler is not None else None,
            "step_count": view.step_count}
    return {"model": {**others, **params}, "optimizer": {"state": state, "param_groups": groups}, "zero": meta}


# Dtypes the collectives carry; tensors of others (bool buffers, ...) travel in the structure.
_WIRE_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8,
                torch.uint8}


class _TensorSlot:
    """Stands for a tensor in the broadcast structure; the tensor follows on its own."""

    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _strip(state):
    """(structure with a _TensorSlot for each tensor the collectives carry, those tensors)."""
    tensors = []

    def strip(x):
        if torch.is_tensor(x) and x.dtype in _WIRE_DTYPES:
            tensors.append(x)
            return _TensorSlot(x)
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x
    return strip(state), tensors


def _not_consolidated(state, source):
    """Why rank 0's `state` is no consolidated checkpoint, or None."""
    if not isinstance(state, dict) or not {"model", "optimizer"} <= state.keys():
        found = sorted(map(str, state.keys())) if isinstance(state, dict) else type(state).__name__
        return (f"{source} is not a consolidated checkpoint (found {found}; expected a dict with the 'model' and "
                "'optimizer' of hvd.zero.consolidated_state_dict or save_checkpoint(format='consolidated'))")
    return None


def _share_structure(state, source, scope, failure=None, check=_not_consolidated):
    """The root's state without its tensors, on every rank, plus (root only) the
    tensors. The root sends either the structure or why it has none (`failure` while
    reading `source`, or what `check` finds wrong with it); then every rank raises."""
    tensors = []
    if scope.is_root():
        problem = (f"reading {source} failed with {type(failure).__name__}: {failure}" if failure is not None
                   else check(state, source))
        if problem is None:
            skeleton, tensors = _strip(state)
            payload = {"structure": skeleton}
        else:
            payload = {"error": problem}
    else:
        payload = None
    payload = broadcast_object(payload, root_rank=scope.root, name="zero.ckpt.structure", process_set=scope.process_set)
    if "error" in payload:
        raise RuntimeError(f"Rank 0 could not load the checkpoint, so no rank loads it: {payload['error']}") \
            from failure
    return payload["structure"], tensors


def _fill(skeleton, tensors, device, scope):
    """The structure with its tensors: rank 0's, each sent by a broadcast of its own,
    so no rank pickles or holds the whole state."""
    counter = itertools.count()

    def fill(x):
        if isinstance(x, _TensorSlot):
            i = next(counter)
            if scope.is_root():
                t = tensors[i].to(device).contiguous()
            else:
                t = torch.empty(x.shape, dtype=x.dtype, device=device)
            ops.synchronize(ops._enqueue_one(ops._core.OP_BROADCAST, t, t, f"zero.ckpt.tensor.{i}", root=scope.root,
                                              process_set=scope.process_set))
            return t.cpu()
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x
    return fill(skeleton)


def _saved_description(skeleton):
    """What the checkpoint says about its optimizer; for one written before it said
    so, what its structure shows (names by group, shapes; no class)."""
    meta = skeleton.get("zero") or {}
    if meta.get("optimizer"):
        return meta["optimizer"]
    groups = [list(g["params"]) for g in skeleton["optimizer"]["param_groups"]]
    shapes = {n: list(skeleton["model"][n].shape) for names in groups for n in names if n in skeleton["model"]}
    named = not all(n.startswith("param.") for names in groups for n in names)
    return {"class": None, "named": named, "groups": groups, "shapes": shapes}


def _check_fits(skeleton, view):
    """Refuses, on every rank alike and before any tensor moves, a checkpoint that
    does not fit this model and optimizer. Returns the saved group index for each
    param group here."""
    missing = [s.name for s in view.shards if s.name not in skeleton["model"]]
    if missing:
        raise ValueError(f"The checkpoint has no values for parameters {missing[:5]}; was it saved from this model?")
    saved = _saved_description(skeleton)
    opt_state = skeleton["optimizer"]
    compat.check_class(saved, opt_state["param_groups"], opt_state["state"], view.inner)
    return compat.match_groups(saved, view.groups)


def load_consolidated(state, model, opt):
    """Loads a consolidated state (from any world size) into this job. Rank 0 passes
    the object; the other ranks may pass None."""
    _load(state, model, opt, "the state passed on rank 0")


def _load(state, model, opt, source, failure=None):
    view = opt.sharded_state
    with view.materialized(write_back=True):
        _load_into(state, model, view, source, failure)


def _load_into(state, model, view, source, failure):
    skeleton, tensors = _share_structure(state, source, view.scope, failure)
    order = _check_fits(skeleton, view)
    state = _fill(skeleton, tensors, view.device, view.scope)
    model_state, opt_state = state["model"], state["optimizer"]
    with torch.no_grad():
        for s, mp in zip(view.shards, view.masters):
            mp.copy_(shard_of(model_state[s.name], s, view.rank, torch.float32, mp.device))
        load_optimizer_shards(view, opt_state, order)
        if model is not None:
            named = dict(model.named_parameters(remove_duplicate=False))  # tied names too
            others = {k: v for k, v in model_state.items() if k not in named}
            for k, v in model.state_dict().items():
                if k in others:
                    v.copy_(others[k])
    meta = state.get("zero") or {}
    if view.loss_scaler is not None and meta.get("loss_scaler"):
        view.loss_scaler.load_state_dict(meta["loss_scaler"])
    view.set_step_count(meta.get("step_count"))
    view.publish()


def shard_of(full, s, rank, dtype, device):
    """Rank `rank`'s shard of parameter `s` cut from `full` (any tensor of its numel):
    elements [rank * shard, (rank + 1) * shard) of the flattened tensor, zero-padded."""
    lo, hi = s.my_range(rank)
    out = torch.zeros(s.shard, dtype=dtype, device=device)
    out[:hi - lo] = full.reshape(-1)[lo:hi]
    return out


def load_optimizer_shards(view, opt_state, order, keep=()):
    """Loads this rank's part of a full (unsharded) optimizer state into the inner
    optimizer: `opt_state` is {"state": {name: {key: value}}, "param_groups": [{..., "params":
    [names]}]}, its tensors shaped like their parameters. A state tensor with a parameter's
    number of elements is cut to this rank's shard (floating-point ones in the masters'
    dtype); other values (a step count) are copied. A parameter without state there has
    none here afterwards. Param group g takes the hyperparameters of the saved group
    order[g], except the `keep` keys. Call it inside view.materialized(write_back=True)."""
    inner = view.inner
    with torch.no_grad():
        for s, mp in zip(view.shards, view.masters):
            entry = {}
            for key, value in opt_state["state"].get(s.name, {}).items():
                if torch.is_tensor(value) and value.numel() == s.numel and value.dim() > 0:
                    dtype = mp.dtype if value.is_floating_point() else value.dtype
                    entry[key] = shard_of(value, s, view.rank, dtype, mp.device)
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            if entry:
                inner.state[mp] = entry
            else:
                inner.state.pop(mp, None)
        for group, i in zip(inner.param_groups, order):
            for k, v in opt_state["param_groups"][i].items():
                if k not in ("params", "param_names") and k not in keep:
                    group[k] = v


def save_file(path, model, opt):
    """Writes the consolidated state to `path` from rank 0, atomically: a temporary
    file in the same folder, flushed, then renamed over `path`."""
    state = consolidated_state_dict(model, opt)
    failure, scope = None, opt.sharded_state.scope
    if scope.is_root():
        try:
            _write(path, state)
        except Exception as e:  # every rank must hear of it, not wait for rank 0
            failure = e
    # Also the barrier: no rank returns before the file is in place.
    problem = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}",
                               root_rank=scope.root, name="zero.ckpt.saved", process_set=scope.process_set)
    if problem is not None:
        raise RuntimeError(f"Rank 0 could not write the checkpoint {path!r}: {problem}") from failure


def _write(path, state):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_file(path, model, opt):
    """Reads a file written by save_file (by a job of any size)."""
    state, failure = None, None
    if opt.sharded_state.scope.is_root():
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # sent to every rank, which then all raise
            failure = e
    _load(state, model, opt, repr(path), failure)
