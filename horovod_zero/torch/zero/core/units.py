"""Stage 3 gather units: which modules are gathered and freed together, and which
parameters belong to each. By default each module of the model's largest
nn.ModuleList is a unit; units= (module classes or instances) overrides. A
parameter reachable from one unit only belongs to it; one reachable from several
units, or also from a module outside every unit (a tied embedding and output
head, a shared layer), belongs to the root, which stays gathered for the whole
forward and backward. So tied and shared parameters need no registration."""

import torch


def find_units(model, units):
    """The unit modules, in model.modules() order."""
    if units is None:
        return _largest_module_list(model)
    classes = tuple(u for u in units if isinstance(u, type))
    instances = [u for u in units if not isinstance(u, type)]
    bad = [u for u in instances if not isinstance(u, torch.nn.Module)]
    if bad:
        raise ValueError(f"units= takes module classes or module instances; got {bad[:3]}.")
    found = [m for m in model.modules() if (classes and isinstance(m, classes)) or any(m is u for u in instances)]
    missing = [type(u).__name__ for u in instances if not any(u is m for m in found)]
    if missing:
        raise ValueError(f"units= names modules that are not in the model: {missing[:3]}.")
    if not found:
        raise ValueError(f"units={units!r} matches no module of the model.")
    _check_disjoint(model, found)
    return found


def wait_units(model, units):
    """overlap_param_gather's units: as find_units(), but a model without an nn.ModuleList
    (and no units=) has none, and the root waits for every parameter."""
    if units is None and not any(isinstance(m, torch.nn.ModuleList) and len(m) for m in model.modules()):
        return []
    return find_units(model, units)


def _largest_module_list(model):
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            "stage=3 needs gather units, and the model has no nn.ModuleList to take them from. Pass units= "
            "(the module classes or instances to gather one at a time, e.g. units=[MyBlock]); a model that is "
            "gathered whole saves no memory over ZeRO stages 1 and 2, so use stage=2 for it.")
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


def _check_disjoint(model, found):
    """A unit inside another unit is refused. A module shared by two units that is no unit
    itself (a layer two blocks both call) is not: its parameters belong to the root."""
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    units = set(found)
    for u in found:
        for m in u.modules():
            if m is not u and m in units:
                raise ValueError(
                    f"units= puts module '{names.get(m, type(m).__name__)}' in two units: it is a unit, and it is "
                    f"inside unit '{names.get(u, '?')}'. A module can be in one unit only: list either the outer "
                    "or the inner modules.")


def assign(model, unit_modules, shard_of):
    """(per unit: the shard indices of its parameters, the root's shard indices)."""
    inside = {m for u in unit_modules for m in u.modules()}
    outside = {id(p) for m in model.modules() if m not in inside for p in m.parameters(recurse=False)}
    reach = {}
    for k, u in enumerate(unit_modules):
        for p in u.parameters():
            reach.setdefault(p, set()).add(k)
    per_unit = [[] for _ in unit_modules]
    root = []
    for p, s in shard_of.items():
        ks = reach.get(p, set())
        if len(ks) == 1 and id(p) not in outside:
            per_unit[next(iter(ks))].append(s.index)
        else:
            root.append(s.index)
    return [sorted(u) for u in per_unit], sorted(root)
