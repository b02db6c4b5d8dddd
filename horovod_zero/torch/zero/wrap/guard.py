"""Changes made after wrapping that would make training silently wrong, detected at
step(). Each check compares identities and data pointers only (no values), so it
costs microseconds per parameter.

- The inner optimizer's param groups changed (opt.optimizer.add_param_group):
  the new parameters would step on unreduced local gradients and ranks diverge.
- A parameter's storage was replaced (model.float(), .half(), .to(), `p.data =`):
  the allgather writes the updates into the old storage, so it stops training.
- A module's Parameter was replaced (`module.weight = nn.Parameter(...)`): the
  new one is in no optimizer and never updates.
"""

GRAD_SCALER = (
    "torch.amp.GradScaler cannot drive DistributedZeroOptimizer: the gradients it would unscale and check "
    "exist only inside opt.step() (as reduced fp32 shards), and each rank would decide alone whether to skip "
    "the step. Use the built-in loss scaling instead: pass loss_scaler=hvd.zero.LossScaler() (on by default "
    "with param_dtype=torch.float16), call loss = opt.scale_loss(loss) before backward(), and opt.step() "
    "directly; an overflow on any rank skips the step on every rank.")


def module_slots(model, params):
    """(module, attribute, parameter, name) for each place where `model` holds one of `params`."""
    wanted = set(params)
    return [(m, leaf, p, f"{prefix}.{leaf}" if prefix else leaf)
            for prefix, m in model.named_modules()
            for leaf, p in m._parameters.items() if p is not None and p in wanted]


def check_groups(param_groups, views, ngroups):
    """The inner optimizer must still hold exactly the shard views it was given."""
    held = [p for g in param_groups for p in g["params"]]
    if len(param_groups) == ngroups and len(held) == len(views) and all(a is b for a, b in zip(held, views)):
        return
    raise RuntimeError(
        f"The inner optimizer's param groups changed after wrapping: it holds {len(param_groups)} group(s) of "
        f"{len(held)} parameters, DistributedZeroOptimizer sharded {ngroups} group(s) of {len(views)}. Parameters "
        "added through opt.optimizer.add_param_group() (or by editing group['params']) are not sharded and "
        "would step on this rank's own gradients, so ranks would silently diverge. Add all param groups "
        "before wrapping, or call add_param_group() on the DistributedZeroOptimizer (on every rank).")


def check_storage(storage, indices):
    """Each parameter must still use the buffer its updates are gathered into."""
    for i in indices:
        if not storage.holds_storage(i):
            s, p, store = storage.shards[i], storage.params[i], storage.stores[i]
            raise RuntimeError(
                f"Parameter '{s.name}' no longer uses the storage DistributedZeroOptimizer writes its updates "
                f"into: it is now {p.dtype} on {p.device}, it was wrapped as {store.dtype} on {store.device}. "
                "model.float()/.half()/.to() (or `param.data = ...`) after wrapping replaces the storage, and the "
                "parameter would silently stop training. Change the model's dtype or device before wrapping the "
                "optimizer; to train in lower precision, pass param_dtype= to DistributedZeroOptimizer.")


def check_slots(slots):
    """The model must still hold the Parameter objects the optimizer was built with."""
    for module, leaf, p, name in slots:
        if module._parameters.get(leaf) is not p:
            raise RuntimeError(
                f"Parameter '{name}' of the model is not the Parameter the optimizer was built with: it was "
                "replaced after wrapping (e.g. `module.weight = nn.Parameter(...)`), and the new one would never "
                "be updated. Replace parameters before building and wrapping the optimizer.")
