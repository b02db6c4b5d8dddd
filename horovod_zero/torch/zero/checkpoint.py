"""Consolidated checkpoints: full fp32 parameters and optimizer state gathered on
rank 0, loadable into a job of any size."""

import itertools
import os

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import rank
from horovod_zero.torch.functions import broadcast_object


def _gather_full(t, s, name):
    """A shard-shaped tensor (this rank's part of parameter `s`) -> the full tensor."""
    full = mpi_ops.allgather(t.detach().float().contiguous(), name=name)
    return full[:s.numel].view(s.shape).cpu()


def consolidated_state_dict(model, opt):
    """Full fp32 parameters (and the model's other state) plus the optimizer state,
    on rank 0; None on the other ranks. Every rank must call it."""
    inner = opt.optimizer
    params, state = {}, {}
    for s, mp in zip(opt._shards, opt._master_params):
        params[s.name] = _gather_full(mp, s, f"zero.ckpt.param.{s.index}")
        entry = {}
        for key, value in sorted(inner.state.get(mp, {}).items()):
            if torch.is_tensor(value) and value.shape == mp.shape:
                entry[key] = _gather_full(value, s, f"zero.ckpt.state.{s.index}.{key}")
            else:
                entry[key] = value.cpu() if torch.is_tensor(value) else value
        state[s.name] = entry
    if rank() != 0:
        return None
    others = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in params} if model is not None else {}
    groups = []
    for g, group in enumerate(inner.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["params"] = [s.name for s in opt._plan[g]]
        groups.append(hyper)
    return {"model": {**others, **params}, "optimizer": {"state": state, "param_groups": groups}}


# Dtypes the collectives carry; tensors of others (bool buffers, ...) travel in the structure.
_WIRE_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8,
                torch.uint8}


class _TensorSlot:
    """Stands for a tensor in the broadcast structure; the tensor follows on its own."""

    def __init__(self, t):
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _share(state, device):
    """Rank 0's state on every rank: the structure (small) as one object, then each
    tensor by a broadcast of its own, so no rank pickles or holds the whole state."""
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

    skeleton = broadcast_object(strip(state) if rank() == 0 else None, root_rank=0, name="zero.ckpt.structure")
    counter = itertools.count()

    def fill(x):
        if isinstance(x, _TensorSlot):
            i = next(counter)
            if rank() == 0:
                t = tensors[i].to(device).contiguous()
            else:
                t = torch.empty(x.shape, dtype=x.dtype, device=device)
            mpi_ops.broadcast_(t, 0, name=f"zero.ckpt.tensor.{i}")
            return t.cpu()
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    return fill(skeleton)


def load_consolidated(state, model, opt):
    """Loads a consolidated state (from any world size) into this job. Rank 0 passes
    the object; the other ranks may pass None."""
    state = _share(state, opt._device)
    inner = opt.optimizer
    model_state, opt_state = state["model"], state["optimizer"]
    missing = [s.name for s in opt._shards if s.name not in model_state]
    if missing:
        raise ValueError(f"The checkpoint has no values for parameters {missing[:5]}; was it saved from this model?")
    r = opt._rank
    with torch.no_grad():
        for s, mp in zip(opt._shards, opt._master_params):
            full = model_state[s.name].reshape(-1).float()
            padded = torch.zeros(s.padded, dtype=torch.float32)
            padded[:s.numel] = full
            mp.copy_(padded[r * s.shard:(r + 1) * s.shard].to(mp.device))
            entry = {}
            for key, value in opt_state["state"].get(s.name, {}).items():
                if torch.is_tensor(value) and value.numel() == s.numel and value.dim() > 0:
                    pv = torch.zeros(s.padded, dtype=value.dtype)
                    pv[:s.numel] = value.reshape(-1)
                    entry[key] = pv[r * s.shard:(r + 1) * s.shard].to(mp.device).clone()
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            if entry:
                inner.state[mp] = entry
        for group, saved in zip(inner.param_groups, opt_state["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        if model is not None:
            named = dict(model.named_parameters())
            others = {k: v for k, v in model_state.items() if k not in named}
            for k, v in model.state_dict().items():
                if k in others:
                    v.copy_(others[k])
    opt._gather_params()


def save_checkpoint(path, model, opt):
    """Writes the consolidated state to `path` from rank 0, atomically: a temporary
    file in the same folder, flushed, then renamed over `path`."""
    state = consolidated_state_dict(model, opt)
    if rank() == 0:
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    mpi_ops.barrier()


def load_checkpoint(path, model, opt):
    """Reads a checkpoint written by save_checkpoint (by a job of any size)."""
    state = torch.load(path, map_location="cpu", weights_only=False) if rank() == 0 else None
    load_consolidated(state, model, opt)
