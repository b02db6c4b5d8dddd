"""Stage 3: the hooks that gather each unit's parameters just before they are
used and free them after, in forward and again in backward, prefetching the
next units in recorded order (order.py).

[Note: stage 3 hooks]
- Root (the model): its pre-forward hook gathers the parameters outside every
  unit; they stay gathered until the end of backward (a forward without grad frees
  them at its end). With reshard_root_after_forward (FSDP2's root with
  reshard_after_forward=True) its post-forward hook frees them instead and passes
  the model's outputs through _OnBackward, whose backward gathers them again (with
  the first units of backward) once the loss's backward reaches the model: the loss
  is computed without them. Not when an output is a view of a root parameter.
- A unit's pre-forward hook issues its gather and the next HOROVOD_ZERO_PREFETCH
  units' (forward order), then waits for its own. Its post-forward hook frees
  it (reshard_after_forward=True, or always without grad) and passes its outputs
  through _OnBackward, whose backward gathers it again (with the next units in
  backward order) before any of the unit's backward runs. Its inputs pass through
  another _OnBackward, whose backward runs once the unit's backward has produced the
  input gradients: the unit is freed there and the gradient bucket flushed.
- A forward inside backward is activation checkpointing's recomputation: the unit
  (or root) is gathered if it is not, and stays gathered for the backward that follows;
  no order is recorded. Its inputs pass through _OnBackward as in a forward: reentrant
  checkpointing runs backward through the recomputed graph, and that frees the unit.
- The first unit (or root) gathered in a backward queues a callback for the end of it,
  which frees whatever is still gathered (units whose inputs needed no grad,
  gathers prefetched but not used, the root) and records the backward order.
Every rank must run the same units in the same order, as with any collective.

Stage3 is the optimizer's Params at stage 3 (core/protocols.py): publishing new
values is freeing every unit, since the next forward gathers them anyway."""

import contextlib
import enum
import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from horovod_zero.torch.zero.core.units import assign
from horovod_zero.torch.zero.core.weak import check_hook, weak_hook
from horovod_zero.torch.zero.stage3.order import OrderTrace


class State(enum.Enum):
    RESHARDED = "resharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    def __init__(self, index, module, name):
        self.index, self.module, self.name = index, module, name
        self.params = []  # shard indices
        self.state = State.RESHARDED


class Stage3:
    def __init__(self, model, unit_modules, storage, gatherer, reducer, tuning, reshard_after_forward,
                 reshard_root_after_forward=False):
        self._storage, self._gatherer, self._reducer = storage, gatherer, reducer
        self._model = model
        self._tuning = tuning  # .prefetch: units gathered ahead ([Note: tuned ZeRO settings] in core/tuning.py)
        self._reshard_after_forward = reshard_after_forward
        self._reshard_root = reshard_root_after_forward
        names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
        self.units = [Unit(k, m, names.get(m, type(m).__name__)) for k, m in enumerate(unit_modules)]
        self.root = Unit(-1, model, "<root>")
        self.forward_order, self.backward_order = OrderTrace(), OrderTrace()
        self.pinned = False  # gathered_params(): every parameter stays gathered, hooks do nothing
        self._final_queued = False
        # Made here, not at import: torch._dynamo is imported only by those who wrap a model.
        self._eager = torch._dynamo.disable(_call, recursive=True,
                                            reason="horovod_zero's stage-3 backward hooks call into its runtime")
        self.assign()
        self.hooks = [model.register_forward_pre_hook(weak_hook(self, "root_pre_forward"), with_kwargs=True),
                      model.register_forward_hook(weak_hook(self, "root_post_forward"), with_kwargs=True)]
        for u in self.units:
            self.hooks.append(u.module.register_forward_pre_hook(weak_hook(self, "pre_forward", u), with_kwargs=True))
            self.hooks.append(u.module.register_forward_hook(weak_hook(self, "post_forward", u), with_kwargs=True))
            # Registered after pre_forward, so the unit's own module is gathered by then.
            for name, m in u.module.named_modules(prefix=u.name):
                if any(True for _ in m.parameters(recurse=False)):
                    self.hooks.append(m.register_forward_pre_hook(check_hook(self, "check_gathered", u, name)))

    def on_new_params(self, params):
        self.assign()

    def forward_checks(self):
        # Every parameter: the gather would otherwise repair the storage of some and hide it.
        return range(len(self._storage.shards))

    def drop_values(self):
        pass  # at rest every unit is freed already

    def publish(self, wait, indices=None):
        self.reshard_all()  # the next forward gathers the new values

    def free(self):
        self.reshard_all()

    def assign(self):
        """(Re)computes which parameters each unit holds (also after add_param_group)."""
        per_unit, root = assign(self._model, [u.module for u in self.units], self._storage.shard_of)
        for u, params in zip(self.units, per_unit):
            u.params = params
        self.root.params = root

    # --- one unit's transitions ---------------------------------------------

    def gather(self, unit):
        if unit.state is State.RESHARDED:
            self._gatherer.gather(unit.params)  # one grouped call: one fused collective
            unit.state = State.GATHERING

    def wait(self, unit, stream_ordered=False):
        """`stream_ordered` (the hooks, just before the unit computes): the compute stream
        waits for the gather on the GPU, the CPU goes on queueing kernels; see [Note:
        stream-ordered waits] in python/adapter.cc."""
        if unit.state is State.GATHERING:
            self._gatherer.wait(unit.params, stream_ordered)
            unit.state = State.GATHERED

    def unshard(self, unit):
        self.gather(unit)
        self.wait(unit, stream_ordered=True)

    def reshard(self, unit):
        if unit.state is State.RESHARDED:
            return  # reshard_all() runs at every backward's end and in zero_grad(): most units are free
        if unit.state is State.GATHERING:
            # Never free storage a gather may still write: a prefetch never used, or a
            # stream-ordered wait that was interrupted, so the compute stream never waited.
            self._gatherer.wait(unit.params)
            self._gatherer.release(unit.params)
        for i in unit.params:
            self._storage.reshard(i)
        unit.state = State.RESHARDED

    def reshard_all(self):
        self._final_queued = False
        for u in self.units + [self.root]:
            self.reshard(u)

    def busy_units(self):
        return [u for u in self.units if u.state is not State.RESHARDED]

    def check_gathered(self, unit, name, module, args):
        if unit.state is State.GATHERED or self.pinned:
            return
        raise RuntimeError(
            f"Module '{name}' ran while its gather unit '{unit.name}' is sharded (ZeRO stage 3): outside the unit's "
            "forward and backward its parameters hold no values. Call it through the unit, read parameters inside "
            "`with opt.gathered_params():`, or choose units= so that it lies outside every unit (then it stays "
            "gathered with the root).")

    def check_at_rest(self):
        busy = self.busy_units()
        if busy:
            raise RuntimeError(
                f"step() while units {[u.name for u in busy[:3]]} are still gathered: the last forward did not "
                "finish its backward (it raised, or backward() was not called), so this step's gradients would miss "
                "them. Call opt.zero_grad(), which frees those gathers, and run forward and backward again.")
        self.reshard(self.root)

    @contextlib.contextmanager
    def gathered(self, rank0_only):
        """Every parameter gathered for the block; `rank0_only`: on the other ranks freed
        again at once, one parameter at a time (they only help rank 0 gather)."""
        free_each = rank0_only and self._storage.rank != 0
        if self.pinned:
            raise RuntimeError("gathered_params() blocks do not nest.")
        self.reshard_all()
        self.pinned = True
        try:
            for u in self.units + [self.root]:
                u.state = State.GATHERED  # first: if a gather fails, reshard_all() frees the unit
                for i in u.params:
                    self._gatherer.gather([i])
                    self._gatherer.wait([i])
                    if free_each:
                        self._storage.reshard(i)
                if free_each:
                    u.state = State.RESHARDED
            yield
        finally:
            self.pinned = False
            self.reshard_all()

    def _prefetch_next(self, trace):
        for k in trace.upcoming(self._tuning.prefetch):
            self.gather(self.units[k])

    # --- hooks -------------------------------------------------------------------

    def root_pre_forward(self, module, args, kwargs):
        if self.pinned:
            return
        if _recomputing():
            self._queue_end_of_backward()  # which frees the root again
            self.unshard(self.root)
            return
        # Left over from a forward that raised, or one whose backward never ran (or raised:
        # autograd then drops the callback queued for its end).
        for u in self.busy_units():
            self.reshard(u)
        self._final_queued = False
        self.forward_order.now, self.forward_order.matching = [], True
        self.unshard(self.root)

    def root_post_forward(self, module, args, kwargs, output):
        if self.pinned or _recomputing():
            return None
        self.forward_order.end()
        self.backward_order.predict(reversed(self.forward_order.last or []))
        if not torch.is_grad_enabled():
            self.reshard_all()  # no backward follows
            return
        for u in self.units:  # prefetched, but this forward took another path
            if u.state is not State.RESHARDED and u.index not in self.forward_order.last:
                self.reshard(u)
        if not self._reshard_root or self._aliases_root(output):
            return None
        through = self._through(self.root_pre_backward, output)
        if through is not None:  # else no backward reaches the model: the root stays gathered
            self.reshard(self.root)
        return through

    def _aliases_root(self, output):
        """Whether an output is a view of a root parameter, which freeing would empty."""
        stores = {self._storage.stores[i].untyped_storage().data_ptr() for i in self.root.params}
        leaves, _ = tree_flatten(output)
        return any(torch.is_tensor(t) and t.untyped_storage().data_ptr() in stores for t in leaves)

    def root_pre_backward(self):
        self._queue_end_of_backward()
        self.gather(self.root)
        self._prefetch_next(self.backward_order)
        self.wait(self.root, stream_ordered=True)

    def pre_forward(self, unit, module, args, kwargs):
        if self.pinned:
            return None
        if _recomputing():
            # Gathered by its pre-backward already, unless its outputs needed no grad (reentrant
            # checkpointing runs the first forward without grad, so only this one has hooks).
            self._queue_end_of_backward()
            self.unshard(unit)
            return self._through(functools.partial(self.post_backward, unit), (args, kwargs))
        self.forward_order.visit(unit.index)
        self.gather(unit)
        self._prefetch_next(self.forward_order)
        self.wait(unit, stream_ordered=True)
        if not torch.is_grad_enabled():
            return None
        return self._through(functools.partial(self.post_backward, unit), (args, kwargs))

    def post_forward(self, unit, module, args, kwargs, output):
        if self.pinned or _recomputing():
            return None  # the unit's backward follows at once: post_backward or the end of backward frees it
        if self._reshard_after_forward or not torch.is_grad_enabled():
            self.reshard(unit)
        if not torch.is_grad_enabled():
            return None
        return self._through(functools.partial(self.pre_backward, unit), output)

    def _through(self, on_backward, tree):
        """_through() with on_backward called outside dynamo: under compiled autograd the
        backward hooks would otherwise be traced, and they call into the runtime."""
        return _through(functools.partial(self._eager, on_backward), tree)

    def _queue_end_of_backward(self):
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def pre_backward(self, unit):
        self._queue_end_of_backward()
        self.backward_order.visit(unit.index)
        self.gather(unit)
        self._prefetch_next(self.backward_order)
        self.wait(unit, stream_ordered=True)

    def post_backward(self, unit):
        self.reshard(unit)
        self._reducer.flush()

    def _end_of_backward(self):
        self.backward_order.end()
        self.reshard_all()
        self._gatherer.release_finished()
        self._reducer.flush()


def _recomputing():
    """Whether a forward runs inside backward: activation checkpointing recomputing a
    unit (torch.utils.checkpoint) just before the unit's backward needs what it saves.
    Such a forward keeps the unit gathered and records no order (see [Note: stage 3
    hooks])."""
    return torch._C._current_graph_task_id() != -1


def _through(on_backward, tree):
    """`tree` with its tensors that need grad passed through one _OnBackward node, or
    None when none needs grad."""
    simple = _simple_through(on_backward, tree)
    if simple is not _NOT_SIMPLE:
        return simple
    leaves, spec = tree_flatten(tree)
    at = [k for k, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
    if not at:
        return None
    outs = _OnBackward.apply(on_backward, *[leaves[k] for k in at])
    for k, t in zip(at, outs):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


_NOT_SIMPLE = object()
_LEAVES = (torch.Tensor, int, float, str, type(None))


def _simple_through(on_backward, tree):
    """_through() of the trees nearly every unit sees, without pytree (whose flatten
    costs the host 20 us a call, four times per unit and step): one tensor (an output),
    or (args, kwargs) whose values are all leaves (a forward's inputs). _NOT_SIMPLE
    for any other tree."""
    if isinstance(tree, torch.Tensor):
        return _OnBackward.apply(on_backward, tree)[0] if tree.requires_grad else None
    if type(tree) is not tuple or len(tree) != 2 or type(tree[0]) is not tuple or type(tree[1]) is not dict:
        return _NOT_SIMPLE
    args, kwargs = tree
    if not all(isinstance(v, _LEAVES) for v in args) or not all(isinstance(v, _LEAVES) for v in kwargs.values()):
        return _NOT_SIMPLE
    at = [k for k, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    keys = [k for k, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at and not keys:
        return None
    outs = _OnBackward.apply(on_backward, *[args[k] for k in at], *[kwargs[k] for k in keys])
    args, kwargs = list(args), dict(kwargs)
    for k, t in zip(at, outs):
        args[k] = t
    for k, t in zip(keys, outs[len(at):]):
        kwargs[k] = t
    return tuple(args), kwargs


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors; its backward first calls on_backward(). On a unit's
    outputs that runs before the unit's backward (to gather it), on its inputs after
    (to free it)."""

    @staticmethod
    def forward(ctx, on_backward, *tensors):
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None,) + grads


def _call(fn):
    fn()
