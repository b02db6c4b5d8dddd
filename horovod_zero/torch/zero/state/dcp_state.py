"""The optimizer's sharded state in the layout FSDP2 checkpoints with DCP: what
torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) returns,
saved as {"model": ..., "optim": ...}:

- model.<name>: every state_dict() entry; tied parameters under each of their names;
- optim.state.<first name>.<key>: the inner optimizer's state (step, exp_avg, ...);
- optim.param_groups.<g>.<hyperparameter>, with "params" the groups' parameter names;
- zero.step_count and zero.loss_scaler: ours; FSDP2 ignores them.

Trained parameters and their state are this rank's flat slices (dcp_layout.FlatSlice),
so the files hold every element once, in chunks any job can read back."""

import torch

from horovod_zero.torch.zero.state.dcp_layout import FlatSlice


def _slice(local, s, rank):
    start, stop = s.my_range(rank)
    return FlatSlice(local.detach()[:stop - start], s.shape, start, stop)


def _param_shaped(value, master):
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape


def save_state(model, view):
    """The nested state dict to save (DCP flattens it as FSDP2's is)."""
    index = {p: i for i, p in enumerate(view.params)}
    shards, masters, inner = view.shards, view.masters, view.inner
    model_sd = {}
    covered = set()
    if model is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, t in model.state_dict(keep_vars=True).items():
            i = index.get(params.get(name))
            model_sd[name] = _slice(masters[i], shards[i], view.rank) if i is not None else t.detach()
            covered.add(i)
    for s, m in zip(shards, masters):  # every trained parameter, also one a custom state_dict() leaves out
        if s.index not in covered:
            model_sd[s.name] = _slice(m, s, view.rank)
    state = {}
    for s, mp in zip(shards, masters):
        entry = inner.state.get(mp)
        if entry:
            state[s.name] = {k: _slice(v, s, view.rank) if _param_shaped(v, mp) else v for k, v in entry.items()}
    groups = []
    for g, group in enumerate(inner.param_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [s.name for s in view.groups[g]]})
    scaler = view.loss_scaler
    return {"model": model_sd, "optim": {"state": state, "param_groups": groups},
            "zero": {"step_count": view.step_count, "loss_scaler": scaler.state_dict() if scaler else None}}


def staged(state):
    """A copy of `state` in host memory (pinned when it comes from the GPU), so that
    training may change the original while the copy is written."""
    if isinstance(state, FlatSlice):
        local = torch.empty(state.local.shape, dtype=state.local.dtype, pin_memory=state.local.is_cuda)
        local.copy_(state.local)
        return FlatSlice(local, state.shape, state.start, state.stop)
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: staged(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(staged(v) for v in state)
    return state


class _Placeholder:
    """Where an object (not a tensor) is read into; the load replaces it."""


def _split(key):
    """A flat key's path, for checkpoints without the planner's record of it. Names hold
    dots, so the split follows the layout: model.<name>, optim.state.<name>.<key>."""
    head, _, rest = key.partition(".")
    if head == "optim" and rest.startswith("state."):
        name, _, k = rest[len("state."):].rpartition(".")
        return ("optim", "state", name, k)
    if head == "optim":
        return ("optim",) + tuple(rest.split("."))
    return (head, rest)


def _paths(metadata):
    """Flat key -> its path of nested keys (from the planner's record, as DCP flattened it)."""
    recorded = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {k: tuple(map(str, recorded[k])) if k in recorded else _split(k) for k in metadata.state_dict_metadata}


class LoadTarget:
    """What to read from a checkpoint (given its metadata) into this model and optimizer,
    checked against both first, and how to apply it once read."""

    def __init__(self, model, view, metadata):
        self.view, self.flat = view, {}
        self._model, self._paths = model, _paths(metadata)
        self._md = metadata.state_dict_metadata
        self._check_and_plan_model()
        self._plan_optimizer()
        for key, path in self._paths.items():
            if path[0] == "zero" or path[:2] == ("optim", "param_groups"):
                self.flat[key] = _Placeholder()

    def _saved_model(self):
        return {".".join(p[1:]): k for k, p in self._paths.items() if p[0] == "model"}

    def _nested(self, *prefix):
        """The objects read under `prefix`, nested as they were saved (list indices as strings)."""
        out = {}
        for key, path in self._paths.items():
            if path[:len(prefix)] == prefix and len(path) > len(prefix):
                node = out
                for part in path[len(prefix):-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = self.flat[key]
        return out

    def _check_and_plan_model(self):
        view, saved = self.view, self._saved_model()
        index = {p: i for i, p in enumerate(view.params)}
        wanted, aliases, seen = {}, set(), set()
        if self._model is not None:
            params = dict(self._model.named_parameters(remove_duplicate=False))
            for name, t in self._model.state_dict(keep_vars=True).items():
                i = index.get(params.get(name))
                if i is None:
                    wanted[name] = (t.detach(), tuple(t.shape))
                elif i in seen:
                    aliases.add(name)  # a tied parameter's other name: its values come with the first
                else:
                    seen.add(i)
                    wanted[name] = (i, tuple(view.shards[i].shape))
        for s in view.shards:  # every trained parameter, also one a custom state_dict() leaves out
            if s.index not in seen:
                wanted[s.name] = (s.index, tuple(s.shape))
        missing = [n for n in wanted if n not in saved]
        unexpected = [n for n in saved if n not in wanted and n not in aliases]
        shapes = [f"{n}: saved {tuple(self._md[saved[n]].size)}, here {shape}" for n, (_, shape) in wanted.items()
                  if n in saved and hasattr(self._md[saved[n]], "size") and tuple(self._md[saved[n]].size) != shape]
        problems = []
        if missing:
            problems.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            problems.append(f"shapes that differ ({'; '.join(shapes[:5])})")
        if problems:
            raise ValueError("The checkpoint does not fit this model: " + ", ".join(problems) +
                             ". Load it into the model it was saved from.")
        for name, (source, _) in wanted.items():
            key = saved[name]
            if isinstance(source, int):
                s = view.shards[source]
                self.flat[key] = _slice(view.masters[source], s, view.rank)
            else:
                self.flat[key] = source  # read in place: buffers and untrained parameters, whole

    def _plan_optimizer(self):
        """Buffers for the saved optimizer state of each trained parameter."""
        view = self.view
        by_name = {}
        for key, path in self._paths.items():
            if len(path) == 4 and path[:2] == ("optim", "state"):
                by_name.setdefault(path[2], {})[path[3]] = key
        self._state = {}  # shard index -> {state key: tensor or placeholder key}
        for s, mp in zip(view.shards, view.masters):
            entry = {}
            for k, key in by_name.get(s.name, {}).items():
                md = self._md[key]
                if not hasattr(md, "size"):
                    self.flat[key] = _Placeholder()
                    entry[k] = key
                elif tuple(md.size) == tuple(s.shape) and (len(md.size) > 0 or k != "step"):  # 0-dim params too
                    buf = torch.zeros(mp.shape, dtype=md.properties.dtype, device=mp.device)
                    self.flat[key] = _slice(buf, s, view.rank)
                    entry[k] = buf
                elif md.size.numel() == 1:
                    self.flat[key] = entry[k] = torch.zeros(md.size, dtype=md.properties.dtype)
                else:
                    raise ValueError(f"The checkpoint's optimizer state {k!r} of {s.name} has shape "
                                     f"{tuple(md.size)}; only state shaped like the parameter {tuple(s.shape)} or "
                                     "scalars can be resharded.")
            if entry:
                self._state[s.index] = entry

    def _value(self, entry_value):
        return self.flat[entry_value] if isinstance(entry_value, str) else entry_value

    def objects(self):
        """The keys of what is read first: every object (not tensor). check() looks at them
        before any tensor is read into the shards."""
        return {k: v for k, v in self.flat.items() if isinstance(v, _Placeholder)}

    def tensors(self):
        return {k: v for k, v in self.flat.items() if not isinstance(v, _Placeholder)}

    def take(self, objects):
        self.flat.update(objects)

    def check(self):
        """Refuses, before any tensor is read, param groups that match none of the
        checkpoint's, or another optimizer class (its groups have other hyperparameters)."""
        saved = self._nested("optim", "param_groups")
        inner, self._matched = self.view.inner, []
        for g, group in enumerate(inner.param_groups):
            names = [s.name for s in self.view.groups[g]]
            match = [h for h in saved.values() if set(h.get("params") or []) == set(names)]
            if not match:
                raise ValueError(f"The checkpoint has no param group of exactly the parameters of group {g} here "
                                 f"({names[:3]}{' ...' if len(names) > 3 else ''}): it groups them another way. "
                                 "Build the param groups as in the job that saved it.")
            keys = lambda d: set(d) - _OPTIONAL  # noqa: E731
            if keys(match[0]) != keys(group):
                raise ValueError(
                    f"The checkpoint's param group of {names[:1]} has hyperparameters {sorted(keys(match[0]))}, "
                    f"this {type(inner).__name__}'s have {sorted(keys(group))}: it was saved with another optimizer "
                    "class. Use the same optimizer to resume it.")
            self._matched.append(match[0])

    def apply(self):
        """After the read: the optimizer's state and hyperparameters, the loss scaler and
        the step count take the loaded values (the masters were loaded in place)."""
        view, inner = self.view, self.view.inner
        sd = inner.state_dict()  # for its ids; load_state_dict casts each value as the optimizer needs
        ids = {}
        for group, saved_group in zip(inner.param_groups, sd["param_groups"]):
            ids.update(zip(map(id, group["params"]), saved_group["params"]))
        sd["state"] = {ids[id(view.masters[i])]: {k: self._value(v) for k, v in entry.items()}
                       for i, entry in self._state.items()}
        for group, match in zip(sd["param_groups"], self._matched):
            group.update({k: v for k, v in match.items() if k not in ("params", "param_names")})
        inner.load_state_dict(sd)
        zero = self._nested("zero")
        if view.loss_scaler is not None and zero.get("loss_scaler"):
            view.loss_scaler.load_state_dict(zero["loss_scaler"])
        steps = [v for e in self._state.values() for k, v in e.items() if k == "step"]
        count = zero.get("step_count")
        if count is None and steps:  # a checkpoint of another tool: its optimizer's step
            count = int(self._value(steps[0]))
        view.set_step_count(count)


# Hyperparameters one version of an optimizer has and another lacks, or a scheduler adds:
# they say nothing of the optimizer class.
_OPTIONAL = {"params", "param_names", "initial_lr", "decoupled_weight_decay", "fused", "foreach", "capturable",
             "differentiable", "maximize"}
