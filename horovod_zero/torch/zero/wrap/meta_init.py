"""A model built on the meta device (`with torch.device("meta"): model = build()`)
is made real at wrapping, one gather unit at a time: each parameter and buffer gets
storage on the device it trains on (device=), its module initialises it (`init_fn(module)`, else the module's
`reset_parameters()`), and the optimizer's parameters of that unit are sharded
(storage.py add_groups) before the next unit is made. So no process holds more than
one unit in full, besides its shards.

[Note: the same values as a normal build]
Modules are initialised on the training device in post-order (children before their
parent, siblings in registration order), the order in which building a model normally
runs their constructors' `reset_parameters()`, with that device's generator: the same
seed gives the values of a normal build on that device (`with torch.device(device):`),
and with device="cpu" those of a build on the host. On the GPU the init draws only
device memory and time, where a host init of a 70B model would take minutes. A parent's `reset_parameters()` that re-initialises its
children runs after theirs, as in its constructor. A parameter two modules share
(a tied embedding and head) takes the first module's values; the later module still
initialises a scratch copy, so the generator advances as when its constructor ran.
Every rank makes every unit; the shards then take rank 0's values, as for any model.

[Note: nothing left uninitialised]
Made storage is filled with NaN (floating point) before its module's init runs, and
checked after: a parameter or buffer that the init did not write (a RoPE table
computed in `__init__`, a custom module without `reset_parameters()`) is refused,
naming it, instead of training on garbage."""

import torch

from horovod_zero.torch.zero.core.units import find_units


def is_meta(model, params):
    """Whether the model (or the optimizer's parameters) is on the meta device, all of
    it; partly meta is refused."""
    tensors = list(params) + ([] if model is None else list(model.parameters()) + list(model.buffers()))
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        raise ValueError("Some of the model's parameters or buffers are on the meta device and some are not: build "
                         "the whole model under `with torch.device('meta'):`, or none of it.")
    return bool(tensors) and all(meta)


class MetaInit:
    """add_groups' `batches`: makes the model real in post-order, yielding the optimizer's
    parameters unit by unit (the root's between units) as they become real."""

    def __init__(self, model, units, init_fn, device):
        if model is None:
            raise ValueError("A model on the meta device needs model=: its modules initialise their parameters.")
        self._model = model
        self._init_fn = init_fn
        self._device = torch.device(device)
        self._names = {m: n for n, m in model.named_modules()}
        # Shapes while still meta: a shared parameter may be sharded (empty) by its second module.
        self._like = {id(p): (p.shape, p.dtype) for p in model.parameters()}
        owner = {}
        for k, u in enumerate(find_units(model, units)):
            for m in u.modules():
                owner[m] = k
        self._owner = owner

    def __call__(self, params):
        wanted = {id(p) for p in params}
        pending, current = [], None
        for m in _post_order(self._model):
            unit = self._owner.get(m)
            if pending and unit != current:
                yield pending
                pending = []
            current = unit
            pending += [p for p in self._make(m) if id(p) in wanted]
        if pending:  # every optimizer parameter is in the model (checked with the names, before this)
            yield pending

    def _make(self, m):
        """Makes m's own parameters and buffers real and initialises them; returns the
        parameters made (those shared with an earlier module keep their values)."""
        made, scratch, fresh_buffers = [], {}, []
        for name, p in m._parameters.items():
            if p is None:
                continue
            if p.is_meta:
                real = torch.nn.Parameter(_nan_like(p, self._device), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, real)  # the same object: the optimizer's reference stays valid
                made.append((name, p))
            else:  # made by an earlier module: its init writes a scratch copy
                scratch[name] = p
                shape, dtype = self._like[id(p)]
                m._parameters[name] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=self._device),
                                                         requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = _nan_like(b, self._device)
                fresh_buffers.append(name)
        if not (made or scratch or fresh_buffers):
            return []
        try:
            with torch.no_grad():
                if self._init_fn is not None:
                    self._init_fn(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
                elif made or fresh_buffers:
                    raise ValueError(
                        f"Module '{self._names.get(m) or 'the model'}' ({type(m).__name__}) was built on the meta "
                        "device and has no reset_parameters() to initialise its parameters and buffers: pass "
                        "init_fn= (called with each module, e.g. lambda m: m.init_weights() if hasattr(m, "
                        "'init_weights') else None), or build the model on the host.")
        finally:
            m._parameters.update(scratch)
        self._check_written(m, [(n, p) for n, p in made] + [(n, m._buffers[n]) for n in fresh_buffers])
        return [p for _, p in made]

    def _check_written(self, m, tensors):
        for name, t in tensors:
            if t.is_floating_point() and torch.isnan(t).any():
                where = self._names.get(m) or type(m).__name__
                raise ValueError(
                    f"'{where}.{name}' was built on the meta device and its module's "
                    f"{'init_fn' if self._init_fn else 'reset_parameters()'} did not set it (a buffer computed in "
                    "__init__, such as a RoPE table, is one): pass init_fn= that sets it, or build the model on "
                    "the host.")


def _nan_like(t, device):
    out = torch.empty_like(t, device=device)
    if out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.zero_()
    return out


def _post_order(model):
    """Every module once, children before their parent, siblings in registration order."""
    seen, out = set(), []

    def visit(m):
        if m in seen:
            return
        seen.add(m)
        for c in m.children():
            visit(c)
        out.append(m)
    visit(model)
    return out


def to_meta(model, trained, shards):
    """Turns a wrapped stage-3 model back into a meta model, so that MetaInit can make it
    real again in a job of another size (DistributedZeroOptimizer._rejoin), and returns the
    init_fn for that: the trained parameters become zeros (their committed values are
    loaded after), frozen parameters and buffers get their values back."""
    trained = {id(p): s for p, s in zip(trained, shards)}
    kept = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is None or p.is_meta:
                continue  # a tied parameter, turned already
            s = trained.get(id(p))
            if s is None:
                kept[(m, name)] = p.detach()  # shares the storage the swap leaves behind
            shape = s.shape if s is not None else p.shape
            meta = torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, meta)
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta:
                kept[(m, name)] = b
                m._buffers[name] = torch.empty_like(b, device="meta")

    def init_fn(module):
        with torch.no_grad():
            for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is None:
                    continue
                if (module, name) in kept:
                    t.copy_(kept[(module, name)])
                else:
                    t.zero_()
    return init_fn
