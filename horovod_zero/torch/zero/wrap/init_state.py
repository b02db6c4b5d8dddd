"""Optimizers that create state in their constructor (torch.optim.Adagrad: `step`,
and `sum` filled with initial_accumulator_value). That state is shaped like the
full parameters, but the inner optimizer steps shard views; so it is dropped and
created again for the shards by the optimizer's own constructor.

State left by steps already taken cannot be rebuilt that way (it would be lost),
so wrapping an optimizer that has stepped is still refused: the state must equal
what the constructor creates."""

import torch


def created_state(optimizer, groups):
    """The state that a new instance of `optimizer`'s class, with its defaults,
    creates in its constructor for `groups` (dicts with "params")."""
    cls = type(optimizer).__name__
    try:
        fresh = type(optimizer)([dict(g) for g in groups], **optimizer.defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"The {cls} optimizer holds state made by its constructor. DistributedZeroOptimizer makes that state "
            f"again for the shards by calling {cls}(param_groups, **optimizer.defaults), which failed: {e}. "
            "Give the class a constructor that takes its defaults as keyword arguments, or create the state "
            "lazily in step().") from e
    return dict(fresh.state)


def _same(a, b):
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if torch.is_tensor(x) != torch.is_tensor(y):
            return False
        if torch.is_tensor(x):
            if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def holds_constructor_state(optimizer):
    """Whether `optimizer` holds state; raises if that state is not exactly what its
    constructor creates (it has taken steps). Each parameter is compared with what
    a constructor given that parameter alone creates, so no second copy of the
    whole state is ever held."""
    if not optimizer.state:
        return False
    params = {p for g in optimizer.param_groups for p in g["params"]}
    stepped = any(k not in params for k in optimizer.state)
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for p in group["params"]:
            if stepped:
                break
            made = created_state(optimizer, [{**hyper, "params": [p]}]).get(p, {})
            stepped = not _same(made, optimizer.state.get(p, {}))
    if stepped:
        raise ValueError(
            f"Wrap the optimizer before its first step: it already holds state that its constructor did not "
            f"create ({type(optimizer).__name__} has taken steps, or its state was loaded), and that state is "
            "shaped for full parameters, not shards. Wrap a new optimizer, then load state into the "
            "DistributedZeroOptimizer (load_state_dict, or hvd.zero.load_checkpoint).")
    return True
