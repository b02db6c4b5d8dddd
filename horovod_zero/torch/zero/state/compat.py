"""Whether saved optimizer state fits this optimizer, checked before anything is
loaded: the same optimizer class, and param groups matched by their parameters'
names, so that a job which builds its groups in another order still gives each
group its own hyperparameters and state."""

_NOT_HYPER = ("params", "param_names")


def describe(inner, plan, named):
    """What a checkpoint records about the optimizer it was saved from. `named`:
    whether the names are the model's (model= or named_parameters= given) rather
    than positions (param.0, param.1, ...)."""
    return {"class": type(inner).__name__, "named": named,
            "groups": [[s.name for s in shards] for shards in plan],
            "shapes": {s.name: list(s.shape) for shards in plan for s in shards}}


def positional(plan):
    """The description assumed for a checkpoint that has none (saved before names
    were recorded): its groups are taken to be this optimizer's, in this order."""
    return {"class": None, "named": False, "groups": [[s.name for s in shards] for shards in plan], "shapes": None}


def _hyper_keys(groups):
    return set().union(*(g.keys() for g in groups)) - set(_NOT_HYPER) if groups else set()


def check_class(saved, saved_groups, saved_state, inner):
    """Refuses state saved from another optimizer class. Checkpoints that do not
    record the class are judged by their hyperparameter names."""
    mine = type(inner).__name__
    if saved["class"] is not None:
        if saved["class"] == mine:
            return
        what = f"optimizer class {saved['class']}"
    else:
        theirs, ours = _hyper_keys(saved_groups), _hyper_keys(inner.param_groups)
        if not (theirs - ours and ours - theirs):  # a newer torch only adds hyperparameters
            return
        what = f"an optimizer with hyperparameters {sorted(theirs)}"
    keys = sorted({k for entry in saved_state.values() for k in entry})
    raise ValueError(
        f"The checkpoint holds the state of {what} (state keys {keys}); this optimizer is of class {mine} "
        f"(hyperparameters {sorted(_hyper_keys(inner.param_groups))}). Optimizer state does not carry over "
        "between optimizer classes: to resume, build the optimizer the checkpoint was saved from; to switch "
        "optimizers, load only the model weights (a consolidated checkpoint's 'model' entry: "
        "model.load_state_dict(torch.load(path)['model'])) and wrap the new optimizer after that.")


def match_groups(saved, plan):
    """For each param group of this optimizer (`plan`), the index of the saved
    group that holds the same parameters; raises where there is none."""
    groups = saved["groups"]
    if len(groups) != len(plan):
        raise ValueError(
            f"The checkpoint has {len(groups)} param groups, this optimizer {len(plan)}. Build the optimizer "
            "with the same param groups as when the checkpoint was saved.")
    free = {}
    for i, names in enumerate(groups):
        free.setdefault(frozenset(names), []).append(i)
    order = []
    for g, shards in enumerate(plan):
        candidates = free.get(frozenset(s.name for s in shards))
        if not candidates:
            raise ValueError(_unmatched(saved, g, shards))
        order.append(candidates.pop(0))
    _check_shapes(saved, plan)
    return order


def _unmatched(saved, g, shards):
    mine = [s.name for s in shards]
    theirs = [names[:3] + (["..."] if len(names) > 3 else []) for names in saved["groups"]]
    hint = ("The checkpoint names parameters by position (it was saved without model= or named_parameters=), "
            "so only groups built in the same order match; pass model= when wrapping, before saving and loading."
            if not saved["named"] else
            "Build the optimizer with the same param groups as when saving (their order may differ).")
    return (f"Param group {g} of this optimizer ({len(mine)} parameters: {mine[:3]}{' ...' if len(mine) > 3 else ''}) "
            f"matches no param group of the checkpoint, whose groups hold {theirs}. {hint}")


def _check_shapes(saved, plan):
    shapes = saved["shapes"]
    if shapes is None:
        return
    for shards in plan:
        for s in shards:
            if tuple(shapes[s.name]) != tuple(s.shape):
                raise ValueError(
                    f"Parameter '{s.name}' has shape {tuple(s.shape)} here but {tuple(shapes[s.name])} in the "
                    "checkpoint: it was saved from another model" +
                    ("" if saved["named"] else ", or with param groups in another order (pass model= to match "
                     "them by name)") + ".")


def relay_master(master, shards, saved_names, saved_master):
    """Copies a saved flat master buffer, laid out in `saved_names` order, into
    `master`, laid out in `shards` order (shard sizes agree: same world size)."""
    size = {s.name: s.shard for s in shards}
    offset, at = 0, {}
    for name in saved_names:
        at[name] = offset
        offset += size[name]
    if offset != saved_master.numel():
        raise ValueError(f"The checkpoint's master shard of a param group holds {saved_master.numel()} elements; "
                         f"this optimizer's {offset}. Was it saved from this model at this world size?")
    for s in shards:
        master[s.offset:s.offset + s.shard].copy_(saved_master[at[s.name]:at[s.name] + s.shard])


def reorder_inner(inner_state, order, saved, plan):
    """A torch optimizer state dict whose param groups (and the parameters within
    them) follow this optimizer's order: torch.optim.Optimizer.load_state_dict
    matches saved parameters to its own by position."""
    groups = []
    for shards, i in zip(plan, order):
        src = inner_state["param_groups"][i]
        position = {name: k for k, name in enumerate(saved["groups"][i])}
        perm = [position[s.name] for s in shards]
        group = dict(src, params=[src["params"][k] for k in perm])
        if "param_names" in src:
            group["param_names"] = [src["param_names"][k] for k in perm]
        groups.append(group)
    return {**inner_state, "param_groups": groups}
