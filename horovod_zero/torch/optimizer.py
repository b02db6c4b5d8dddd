"""hvd.DistributedOptimizer: Horovod's data parallelism. Every rank holds the whole
model; each gradient is allreduced (averaged by default) as soon as backward has
produced it, in the background, and step() waits for the results before the
wrapped optimizer steps.

[Note: wrapping, not subclassing at run time]
Horovod builds a subclass of the user's optimizer class at run time and re-runs
its __init__ on the same param groups. This class instead holds the user's
optimizer and forwards to it: param_groups, state and defaults are the wrapped
optimizer's own objects, so changes made through either are seen by both. It
derives from torch.optim.Optimizer (without running its __init__) for one reason:
torch's learning-rate schedulers accept only isinstance(opt, Optimizer), and
Horovod scripts hand them the distributed optimizer. Attributes it does not define
are looked up on the wrapped optimizer.
"""

import contextlib
import warnings
import weakref
from typing import NamedTuple, Optional

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _core
from horovod_zero.torch.compression import Compression
from horovod_zero.torch.process_sets import _id, _size, global_process_set
from horovod_zero.torch.sparse import sparse_allreduce_async


def _forwarded(name, settable=True):
    """A property that reads (and sets) the wrapped optimizer's attribute `name`."""
    get = lambda self: getattr(self.optimizer, name)  # noqa: E731
    put = (lambda self, value: setattr(self.optimizer, name, value)) if settable else None
    return property(get, put)


def _names_of(param_groups, named_parameters):
    """Each trainable parameter's name: the one named_parameters gives it, else
    Horovod's allreduce.noname.<group>.<index>."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
    pairs = list(named_parameters)
    if not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in pairs):
        raise ValueError("named_parameters takes (name, parameter) pairs, such as model.named_parameters().")
    seen, duplicates = set(), set()
    for n, _ in pairs:
        (duplicates if n in seen else seen).add(n)
    if duplicates:
        raise ValueError(f"named_parameters names several parameters {sorted(duplicates)[:5]}: names must be unique.")
    names = {p: n for n, p in pairs}
    unnamed = [(i, j) for i, g in enumerate(param_groups) for j, p in enumerate(g["params"]) if p not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters does not name the optimizer's parameters at (group, index) {unnamed[:5]}: pass "
            "named_parameters() of the model the optimizer was built from.")
    return names


def _reduction_units(params, groups):
    """How gradients are reduced: tuples of parameters reduced together as one
    grouped op (Horovod's groups=), else one parameter each."""
    if groups is None:
        return [(p,) for p in params]
    if isinstance(groups, int):
        n = min(groups, len(params)) or 1
        d, r = divmod(len(params), n)
        bounds = [i * d + min(i, r) for i in range(n + 1)]  # n chunks of near-equal length, in order
        return [tuple(params[bounds[i]:bounds[i + 1]]) for i in range(n) if bounds[i] < bounds[i + 1]]
    trained = set(params)
    units, placed = [], set()
    for group in groups:
        unit = tuple(p for p in group if p in trained)
        if any(p in placed for p in unit):
            raise ValueError("groups lists a parameter more than once; each parameter belongs to one group.")
        placed.update(unit)
        if unit:
            units.append(unit)
    return units + [(p,) for p in params if p not in placed]


class _Reduction(NamedTuple):
    """One gradient's reduction in flight."""
    param: torch.Tensor
    handle: object  # the runtime's handle, or a SparseAllreduceHandle
    wire: Optional[torch.Tensor]  # the tensor allreduced in place; None for a sparse allgather
    ctx: object  # the compressor's context
    densified: bool  # a sparse gradient sent dense (sparse_as_dense)


# Horovod's words, so that filters written for Horovod's warning catch this one too.
_STEP_WITHOUT_SKIP = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                      "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                      "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def _remove_all(handles):
    for h in handles:
        h.remove()


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch.optim optimizer with Horovod's allreduce data parallelism.

    Arguments are Horovod's: `named_parameters` (model.named_parameters(): names the
    allreduces, which must match across ranks), `compression` (hvd.Compression.fp16
    sends float16), `backward_passes_per_step` (gradients accumulate locally over
    that many backward passes, then one allreduce), `op` (hvd.Average or hvd.Sum),
    `gradient_predivide_factor` f (Average only: gradients are scaled by 1/f before
    the sum and by f/size after it), `groups` (an int: that many groups of
    consecutive parameters, each reduced as one grouped op once all its gradients
    are ready; or a list of lists of parameters; `num_groups` is its old name), and
    `sparse_as_dense` (allreduce sparse gradients, e.g. nn.Embedding(sparse=True)'s,
    as dense tensors instead of allgathering their entries), and `process_set`
    (gradients are reduced over its ranks only; on a rank outside it, step() steps
    the wrapped optimizer with the local gradients, as in Horovod).

    A rank on which a parameter got no gradient reduces zeros for it, so every
    rank's gradient is the same (as in Horovod). To change gradients before the
    step (clipping), call synchronize() first, then step() inside
    skip_synchronize(); a step() after synchronize() outside it warns in Horovod's
    words. Horovod's attributes that scripts read are kept: _parameter_names (without
    named_parameters, allreduce.noname.<group>.<index>), _allreduce_delay,
    _requires_update, _handles, _synchronized, _should_synchronize, _compression.
    """

    # GradScaler may only hand its scale to an optimizer's own step; it unscales
    # gradients itself for this one (after synchronize(), as Horovod's docs show).
    _step_supports_amp_scaling = False

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 op=mpi_ops.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("This optimizer is a DistributedOptimizer already; wrap the torch optimizer once.")
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim optimizer, not a {type(optimizer).__name__}.")
        op = mpi_ops._resolve_op(op, None)  # refuses Adasum, saying what to use
        if op not in (mpi_ops.Sum, mpi_ops.Average):
            raise ValueError("DistributedOptimizer reduces gradients with op=hvd.Average (the default) or hvd.Sum.")
        if gradient_predivide_factor != 1.0 and op != mpi_ops.Average:
            raise ValueError("gradient_predivide_factor splits an average: it needs op=hvd.Average.")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: it must be 1 or more.")
        if num_groups:
            warnings.warn("num_groups is Horovod's old name for groups=; pass groups=.", DeprecationWarning)
            groups = num_groups if groups is None else groups
        if groups is not None and not isinstance(groups, list) and not (isinstance(groups, int) and groups > 0):
            raise ValueError("groups takes a number of groups (> 0) or a list of lists of parameters.")
        process_set = global_process_set if process_set is None else process_set
        _id(process_set)  # refuses what is not a registered process set, now rather than in backward
        self.optimizer = optimizer
        self.process_set = process_set
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._groups = groups
        # Horovod's attribute names, which scripts read: each parameter's name, and the backward passes
        # left before its reduction starts.
        self._parameter_names = _names_of(optimizer.param_groups, named_parameters)
        self._named = named_parameters is not None
        self._handles = {}  # unit -> [_Reduction] of the unit's gradients
        self._allreduce_delay = {}
        self._requires_update = set()  # the parameters whose gradients are reduced (hooked), as in Horovod
        self._ready = {}  # unit -> parameters of it whose reduction may start
        self._touched = set()  # parameters whose gradient backward has produced since the last synchronize
        self._synchronized = False
        self._should_synchronize = True
        self._units, self._unit_of = [], {}
        self._hooks = []
        weakref.finalize(self, _remove_all, self._hooks)  # hooks go when the optimizer goes
        # One rank has nothing to reduce (Horovod registers no hooks either), nor has a
        # rank outside the process set.
        self._hooked = process_set.included() and _size(process_set) > 1
        self._add_params([p for g in optimizer.param_groups for p in g["params"]])

    # --- forwarding to the wrapped optimizer ---------------------------------

    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults", settable=False)

    def __getattr__(self, name):
        # Only reached for names this object lacks: the wrapped optimizer's own
        # attributes (a custom optimizer's methods, hooks' registries).
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r})"

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._reset()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        before = {p for g in self.optimizer.param_groups for p in g["params"]}
        self.optimizer.add_param_group(param_group)
        added = [p for p in self.optimizer.param_groups[-1]["params"] if p not in before]
        i = len(self.optimizer.param_groups) - 1
        for j, p in enumerate(self.optimizer.param_groups[-1]["params"]):
            if p in added and p not in self._parameter_names:
                if self._named:
                    raise ValueError("The added param group has parameters named_parameters did not name; "
                                     "build the DistributedOptimizer after adding param groups.")
                self._parameter_names[p] = f"allreduce.noname.{i}.{j}"
        self._add_params(added)

    # --- hooks ---------------------------------------------------------------

    def _add_params(self, params):
        trained = [p for p in params if p.requires_grad]
        groups = self._groups if not self._units else None  # groups= covers the parameters at construction
        for unit in _reduction_units(trained, groups):
            self._units.append(unit)
            self._ready[unit] = 0
            for p in unit:
                self._unit_of[p] = unit
                self._allreduce_delay[p] = self.backward_passes_per_step
                if self._hooked:
                    self._requires_update.add(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook()))

    def _hook(self):
        """A gradient hook that does not keep the optimizer alive: the parameters it
        sits on would otherwise hold the optimizer as long as the model lives."""
        ref = weakref.ref(self)

        def hook(p):
            opt = ref()
            if opt is not None:
                opt._on_grad_ready(p)
        return hook

    def _on_grad_ready(self, p):
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(
                f"The gradient of '{self._parameter_names[p]}' was computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step(). Pass a larger backward_passes_per_step to "
                "accumulate gradients over more backward passes, or call step() (or synchronize()) after each.")
        self._touched.add(p)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] > 0:
            return
        unit = self._unit_of[p]
        self._ready[unit] += 1
        if self._ready[unit] == len(unit):
            self._submit(unit)

    # --- reduction -------------------------------------------------------------

    def _scales(self):
        if self.op == mpi_ops.Average:
            # The runtime divides by size for Average: prescale 1/f, postscale f/size in all.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _submit(self, unit):
        """Starts the reduction of a unit's gradients: dense ones as one (grouped) allreduce
        in place, sparse ones (unless sparse_as_dense) by allgathering their entries."""
        sparse, dense = [], []
        for p in unit:
            if p.grad is None:
                # No gradient here, but other ranks may have one: reduce zeros (Horovod does too).
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_sparse and not self.sparse_as_dense:
                handle = sparse_allreduce_async(g, self._parameter_names[p], self.op, process_set=self.process_set)
                sparse.append(_Reduction(p, handle, None, None, False))
                continue
            wire, ctx = self._compression.compress(g.to_dense() if g.is_sparse else g.contiguous())
            dense.append((p, wire, ctx, g.is_sparse))
        names = [self._parameter_names[p] for p, *_ in dense]
        handles = self._allreduce_in_place([wire for _, wire, _, _ in dense], names)
        self._handles[unit] = sparse + [_Reduction(p, h, *rest) for (p, *rest), h in zip(dense, handles)]

    def _allreduce_in_place(self, tensors, names):
        if not tensors:
            return []
        pre, post = self._scales()
        ps = self.process_set
        if len(tensors) == 1:  # the runtime's cheaper path for one tensor
            return [mpi_ops._enqueue_one(_core.OP_ALLREDUCE, tensors[0], tensors[0], names[0], self.op, pre, post,
                                         process_set=ps)]
        # A grouped op runs on one device: a group spanning a model split over GPUs goes as one per device.
        by_device = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        handles = [None] * len(tensors)
        for idx in by_device.values():
            hs = mpi_ops._enqueue(_core.OP_ALLREDUCE, [tensors[i] for i in idx], [tensors[i] for i in idx],
                                  [names[i] for i in idx], self.op, pre, post, process_set=ps)
            for i, h in zip(idx, hs):
                handles[i] = h
        return handles

    def _finish(self, r, output):
        p = r.param
        if r.wire is None:  # a sparse reduction: its result is the new gradient
            p.grad = output
        elif r.densified:
            p.grad = self._compression.decompress(output, r.ctx).to_sparse()  # the optimizer expects sparse
        elif r.wire is not p.grad:  # else reduced in place already
            p.grad.copy_(self._compression.decompress(output, r.ctx))

    def synchronize(self):
        """Waits for every gradient's reduction, starting those backward has not (a
        parameter without a gradient on this rank, or fewer backward passes than
        backward_passes_per_step). Afterwards every rank holds the reduced gradients."""
        if not self._hooked:
            self._synchronized = True
            return
        try:
            for unit in self._units:
                if unit not in self._handles:
                    self._submit(unit)
            reductions = [r for rs in self._handles.values() for r in rs]
            dense = iter(mpi_ops.synchronize([r.handle for r in reductions if r.wire is not None]))  # one wait
            for r in reductions:
                self._finish(r, next(dense) if r.wire is not None else mpi_ops.synchronize(r.handle))
        finally:
            self._reset()
        self._synchronized = True

    def _reset(self):
        self._handles.clear()
        self._touched.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for unit in self._ready:
            self._ready[unit] = 0
        self._synchronized = False
        self._should_synchronize = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: for after an explicit
        synchronize() (gradient clipping, unscaling)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes):
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes}: it must be 1 or more.")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # --- the step ------------------------------------------------------------

    def step(self, closure=None):
        """Runs `closure` (forward and backward) if given, waits for the gradients'
        reductions, then steps the wrapped optimizer; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_WITHOUT_SKIP, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none=True):
        if self._handles or self._touched:
            raise AssertionError(
                "zero_grad() was called after backward() but before step() or synchronize(): the gradients' "
                "allreduces are running (or accumulating over backward_passes_per_step passes). Call step() or "
                "synchronize() first.")
        self.optimizer.zero_grad(set_to_none=set_to_none)
