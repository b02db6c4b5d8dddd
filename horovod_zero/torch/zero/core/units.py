"""Stage 3 gather units: which modules are gathered and freed together, and which
parameters belong to each. By default (default_units) each module of the model's
largest nn.ModuleList is a unit; without one, each child of its largest
nn.Sequential; without either, each large child of the model; units= (module
classes or instances) overrides. A
parameter reachable from one unit only belongs to it; one reachable from several
units, or also from a module outside every unit (a tied embedding and output
head, a shared layer), belongs to the root, which stays gathered for the whole
forward and backward. So tied and shared parameters need no registration."""

import torch


# A child of the model holding at least this share of its parameters is a unit of its own
# (default_units' last rule); smaller ones stay in the root, gathered for the whole step.
LARGE_CHILD_SHARE = 1 / 32


def find_units(model, units):
    """The unit modules, in model.modules() order."""
    if units is None:
        return default_units(model)
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
    """overlap_param_gather's units: as find_units(); the model's own forward waits for
    the parameters no unit holds (all of them when there is no unit)."""
    return find_units(model, units)


def default_units(model):
    """The units of a model given no units=, from its structure as the stack of layers
    it is built of: the modules of its largest nn.ModuleList (by parameters); else the
    children of the nn.Sequential with the most children that hold parameters (at
    least two; the largest of equals); else, below the wrappers that hold one such child only, the children
    that hold at least LARGE_CHILD_SHARE of the model's parameters. None at all (a model
    of one layer) is no error: the root then holds every parameter, gathered for the
    whole forward and backward, which works but saves no memory over stage 2."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if lists:
        return list(max(lists, key=_numel))
    seqs = [m for m in model.modules() if isinstance(m, torch.nn.Sequential) and len(_holding(m)) >= 2]
    if seqs:  # the longest stack (Sequential(embedding, Sequential(*blocks), head): the blocks)
        return _holding(max(seqs, key=lambda m: (len(_holding(m)), _numel(m))))
    m = model
    while len(_holding(m)) == 1 and not any(True for _ in m.parameters(recurse=False)):
        m = _holding(m)[0]
    total = _numel(model)
    return [c for c in _holding(m) if _numel(c) >= LARGE_CHILD_SHARE * total]


def _numel(module):
    return sum(p.numel() for p in module.parameters())


def _holding(module):
    """The children of `module` that hold parameters."""
    return [c for c in module.children() if _numel(c)]


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
