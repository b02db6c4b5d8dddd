"""DistributedZeroOptimizer: ZeRO stages 1 and 2 over the runtime's collectives.

[Note: where each tensor lives]
- Each model parameter's storage is moved into a zero-padded flat buffer of
  size * shard elements (in param_dtype); the parameter becomes a view of its
  first numel elements. After the inner step the updated fp32 master shards are
  allgathered straight into that buffer with output_dtype=param_dtype, so the
  downcast happens in the runtime's copy-in and param_dtype crosses the wire.
- This rank's fp32 master shards of one param group live in one flat buffer;
  the inner optimizer steps views of it (any torch.optim optimizer).
- Gradients are reduce-scattered (op=Average) from a zero-padded copy of the
  full gradient: stage 2 as each gradient becomes ready in backward (then the full
  gradient is freed), stage 1 when the step (or a coalescing block) needs them.
  The fp32 gradient shards the inner optimizer reads exist only from the
  reduction to zero_grad(): forward and backward, where activations peak, run
  without them (as FSDP2's sharded gradients).
- With overlap_param_gather=True, step() returns once the allgather is queued;
  each module's forward pre-hook waits for its own parameters, so the gather of
  later layers runs under the compute of earlier ones.
- Because the parameters are views of those buffers, changes to the model after
  wrapping that replace them would silently stop training: step() checks for
  them first, and the model's forward pre-hook checks one parameter (guard.py).
"""

import contextlib
import os
import weakref

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _core, rank, size
from horovod_zero.torch.zero import compat, guard
from horovod_zero.torch.zero.cast import cast_floating
from horovod_zero.torch.zero.init_state import created_state, holds_constructor_state
from horovod_zero.torch.zero.loss_scale import LossScaler
from horovod_zero.torch.zero.plan import plan_group

_DOWNCAST_ENV = "HOROVOD_ZERO_DOWNCAST"
_INIT_CHUNK_ENV = "HOROVOD_ZERO_INIT_CHUNK_BYTES"
_BUCKET_ENV = "HOROVOD_ZERO_BUCKET_BYTES"


def _name_map(named):
    """parameter -> its first name (tied parameters have several)."""
    names = {}
    for n, p in named:
        names.setdefault(p, n)
    return names


def _check_in_model(params, names, first_index=0):
    for i, p in enumerate(params, first_index):
        if p not in names:
            raise ValueError(
                f"Parameter {i} of the optimizer (shape {tuple(p.shape)}) is not a parameter of the model. "
                "Build the optimizer from model.parameters() of the model you pass.")


def _check_names(optimizer, model, named_parameters):
    """The names of the model's parameters (None without model= or named_parameters=),
    once the optimizer's parameters are known to be the model's trained ones."""
    if model is not None and named_parameters is not None:
        raise ValueError("Pass model= or named_parameters=, not both.")
    named = list(model.named_parameters() if model is not None else (named_parameters or []))
    if not named:
        return None
    names = _name_map(named)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    _check_in_model(opt_params, names)
    owned = set(opt_params)
    missing = [n for n, p in named if p.requires_grad and p not in owned]
    if missing:
        raise ValueError(
            f"Model parameters {missing[:5]} require grad but are not in the optimizer. Add them to the "
            "optimizer, or set requires_grad=False to freeze them.")
    return names


def _remove_all(handles):
    for h in handles:
        h.remove()


class DistributedZeroOptimizer:
    """Wraps a torch.optim optimizer with ZeRO sharding (stage 1 or 2).

    backward_passes_per_step=N reduces once every N backward passes (gradients are
    summed over the passes and averaged over ranks, as in Horovod).

    fp16 parameters need loss scaling: with param_dtype=torch.float16 (or
    loss_scaler=LossScaler(...)), call loss = opt.scale_loss(loss) before
    backward(); gradients are unscaled in fp32, and a step that overflows on any
    rank is skipped on every rank. torch.amp.GradScaler is refused.

    With param_dtype and model=, floating-point forward inputs of the model are cast
    to param_dtype (cast_forward_inputs=False turns that off).

    Optimizers that create state in their constructor (Adagrad) are accepted: that
    state is made again for the shards.
    """

    def __init__(self, optimizer, model=None, named_parameters=None, stage=2, param_dtype=None,
                 reduce_dtype=None, backward_passes_per_step=1, loss_scaler=None, overlap_param_gather=False,
                 cast_forward_inputs=True):
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}: DistributedZeroOptimizer supports ZeRO stages 1 and 2.")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be 1 or more.")
        if overlap_param_gather and model is None:
            raise ValueError("overlap_param_gather=True needs model=: the model's forward hooks wait for the gather.")
        remake_state = holds_constructor_state(optimizer)
        self.optimizer = optimizer
        self.stage = stage
        self._size, self._rank = size(), rank()
        self._names = _check_names(optimizer, model, named_parameters)
        self._model = weakref.ref(model) if model is not None else None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = self._one_device(params, torch.device("cpu"))
        self._param_dtype = param_dtype
        self._reduce_dtype = reduce_dtype
        self._bpps = backward_passes_per_step
        # shard index -> [handle], one per reduction this step. The padded gradient copy is
        # not kept here: the runtime holds it until its collective finishes, then frees it,
        # so stage 2 never holds more than the gradients still in flight.
        self._pending = {}
        self._had_grad = {}  # shard index -> whether this rank had a gradient for it this step
        self._bucket, self._bucket_bytes = [], 0  # stage 2: gradients taken, not yet submitted
        self._bucket_limit = int(os.environ.get(_BUCKET_ENV, 32 << 20))
        self._reduced = False  # master grads hold this step's reduced gradients
        self._coalescing = False
        if loss_scaler is None and param_dtype == torch.float16:
            loss_scaler = LossScaler()
        self.loss_scaler = loss_scaler
        self._hooks = []
        weakref.finalize(self, _remove_all, self._hooks)  # hooks go when the optimizer goes
        self._gathering = {}  # shard index -> allgather handle still in flight (overlap_param_gather)
        self._after_gather = {}  # shard index -> (store, fp32 copy) to cast once gathered (HOROVOD_ZERO_DOWNCAST=0)
        self._overlap = bool(overlap_param_gather)
        # Filled group by group by _shard_groups, indexed by shard index.
        self._params, self._shards, self._plan, self._master, self._stores, self._master_params = [], [], [], [], [], []
        self._shard_of, self._delay, self._slots = {}, [], []
        optimizer.state.clear()  # constructor state for the full parameters: made again for the shards below
        self._shard_groups(0)
        self._remake_state = remake_state
        if remake_state:
            optimizer.state.update(created_state(optimizer, optimizer.param_groups))
        if self._overlap:
            # A state_dict() taken after step() must see the gathered values.
            self._hooks.append(model.register_state_dict_pre_hook(self._weak("_wait_all_hook")))
        self._cast_to = param_dtype if cast_forward_inputs else None
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._weak("_before_forward"), with_kwargs=True))

    # --- construction ------------------------------------------------------

    def _one_device(self, params, default):
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"Parameters are on several devices {sorted(map(str, devices))}; "
                             "move the model to one device (hvd.device()) before wrapping.")
        return devices.pop() if devices else default

    def _shard_groups(self, first):
        """Shards the param groups from `first` on, which still hold the model's own
        parameters: each becomes a view of zero-padded storage, and the group gets views
        of a flat fp32 master buffer instead."""
        groups = self.optimizer.param_groups[first:]
        params = [p for g in groups for p in g["params"]]
        index = len(self._shards)
        names = self._names or {p: f"param.{i}" for i, p in enumerate(params, index)}
        plan = []
        for g, group in enumerate(groups, first):
            plan.append(plan_group(group["params"], names, self._size, g, index + sum(map(len, plan))))
        shards = [s for g in plan for s in g]
        self._broadcast_initial_values(shards, params)
        chunk = self._init_chunk(shards, params)
        self.init_path = "device" if chunk is None else f"chunked ({chunk} elements)"
        for group, group_shards in zip(groups, plan):
            self._build_group(group, group_shards, chunk)
        self._plan += plan
        self._shards += shards
        self._params += params
        self._shard_of.update(zip(params, shards))
        self._delay += [self._bpps] * len(shards)
        self._hook_params(params)

    def _hook_params(self, params):
        model = self._model() if self._model is not None else None
        if model is not None:
            self._slots += guard.module_slots(model, params)
        if self._overlap and model is not None:
            self._hook_forward(model, set(params))
        if self.stage == 2:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._weak("_on_grad_ready")))

    def _broadcast_initial_values(self, shards, params):
        """Every rank starts from rank 0's values, as DDP does at construction. The fp32
        master shards are built from them, so a broadcast_parameters() after wrapping
        (which would reach the parameters but not the masters) changes nothing."""
        with torch.no_grad():
            handles = [mpi_ops.broadcast_async_(p.data, 0, name=f"zero.init.{s.index}")
                       for s, p in zip(shards, params) if p.is_contiguous()]
            mpi_ops.synchronize(handles)
            for s, p in zip(shards, params):
                if not p.is_contiguous():
                    p.data = mpi_ops.broadcast(p.data.contiguous(), 0, name=f"zero.init.{s.index}")

    def _init_chunk(self, shards, params):
        """None: build on the device directly. Otherwise the number of elements per chunk
        for the fallback, which stages each parameter through host memory so that its
        device copy is freed before its new storage is allocated."""
        forced = os.environ.get(_INIT_CHUNK_ENV)
        if forced:
            return max(1, int(forced) // 4)
        if self._device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self._device)
        biggest = max((p.numel() for p in params), default=0)
        # Master and gradient shards in fp32, plus one parameter's new storage at a time.
        need = 8 * sum(s.shard for s in shards) + 4 * biggest
        return None if need < 0.9 * free else (64 << 20) // 4

    def _rehome(self, s, p, master_slice, chunk):
        """Moves p into zero-padded flat storage and fills its fp32 master shard."""
        lo, hi = s.my_range(self._rank)
        dtype = self._param_dtype or p.dtype
        if chunk is None:
            flat = p.detach().reshape(-1)
            master_slice[:hi - lo].copy_(flat[lo:hi])
            store = torch.zeros(s.padded, dtype=dtype, device=self._device)
            store[:s.numel].copy_(flat)
        else:
            host = p.detach().reshape(-1).to("cpu", copy=True)
            p.data = torch.empty(0, dtype=p.dtype, device=self._device)  # free the device copy first
            store = torch.zeros(s.padded, dtype=dtype, device=self._device)
            for a in range(0, s.numel, chunk):
                b = min(a + chunk, s.numel)
                store[a:b].copy_(host[a:b].to(self._device, non_blocking=False))
            for a in range(lo, hi, chunk):
                b = min(a + chunk, hi)
                master_slice[a - lo:b - lo].copy_(host[a:b].to(self._device))
        p.data = store[:s.numel].view(s.shape)  # the allgather lands here
        return store

    def _build_group(self, group, shards, chunk):
        master = torch.zeros(sum(s.shard for s in shards), dtype=torch.float32, device=self._device)
        views = []
        for s, p in zip(shards, group["params"]):
            self._stores.append(self._rehome(s, p, master[s.offset:s.offset + s.shard], chunk))
            views.append(torch.nn.Parameter(master[s.offset:s.offset + s.shard], requires_grad=p.requires_grad))
        group["params"] = views
        self._master.append(master)
        self._master_params += views

    def _hook_forward(self, model, params):
        """Each module waits, before its forward, for the gather of those of `params` it owns."""
        for m in model.modules():
            own = tuple(self._shard_of[p].index for p in m.parameters(recurse=False) if p in params)
            if own:
                self._hooks.append(m.register_forward_pre_hook(self._weak("_wait_hook", own)))

    def add_param_group(self, param_group):
        """Adds a param group, as torch.optim.Optimizer.add_param_group does, and shards
        it (its parameters start from rank 0's values). Every rank must call it with the
        same group, between steps: not after backward() and before step()."""
        if self._coalescing or self._pending or self._bucket or self._reduced:
            raise RuntimeError("add_param_group() while gradients wait for step(): call it after step() and "
                               "zero_grad(), or before the first backward().")
        group = dict(param_group)
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        self._check_new(params)
        self.optimizer.add_param_group({**group, "params": params})  # validates and fills in the defaults
        self._shard_groups(len(self.optimizer.param_groups) - 1)
        if self._remake_state:
            self.optimizer.state.update(created_state(self.optimizer, self.optimizer.param_groups[-1:]))

    def _check_new(self, params):
        model = self._model() if self._model is not None else None
        if model is not None:
            self._names = _name_map(model.named_parameters())  # the model may have gained modules
        if self._names is not None:
            _check_in_model(params, self._names, len(self._shards))
        seen = set()
        for p in params:
            if p in self._shard_of or p in seen:
                name = self._shard_of[p].name if p in self._shard_of else (self._names or {}).get(p, "")
                raise ValueError(f"Parameter {name!r} (shape {tuple(p.shape)}) is already in a param group of "
                                 "this optimizer; a parameter can be in one group only.")
            seen.add(p)
        self._one_device(params + self._params[:1], self._device)

    def _weak(self, method, *bound):
        """A hook that calls self.<method>(*bound, *args) without keeping self alive: the
        tensors and modules it is registered on would otherwise hold the optimizer (and
        its shards and state) for as long as the model lives."""
        ref = weakref.ref(self)

        def hook(*args):
            opt = ref()
            return None if opt is None else getattr(opt, method)(*bound, *args)
        return hook

    def _before_forward(self, module, args, kwargs):
        # One parameter's storage, O(1) a forward: model.float()/.half()/.to() after wrapping
        # replace every parameter's, and the forward would run on weights that never update.
        guard.check_storage(self._shards[:1], self._params[:1], self._stores[:1])
        if self._cast_to is None:
            return None
        return cast_floating(args, self._cast_to), cast_floating(kwargs, self._cast_to)

    def _wait_all_hook(self, *_):
        self.wait_for_params()

    def _wait_hook(self, indices, module, args):
        if self._gathering:
            self.wait_for_params(indices)

    # --- gradient reduction ----------------------------------------------

    def _padded_grad(self, s, g, dtype):
        if g is not None and s.numel == s.padded and g.dtype == dtype and g.is_contiguous():
            return g.view(-1)  # no padding needed: reduce-scatter it where it is
        buf = torch.zeros(s.padded, dtype=dtype, device=self._device)
        if g is not None:
            buf[:s.numel].copy_(g.reshape(-1))
        return buf

    def _take(self, s, p):
        """Takes p's gradient for reduction: later backward passes start afresh."""
        g, p.grad = p.grad, None
        self._had_grad[s.index] = self._had_grad.get(s.index, False) or g is not None
        return s, g, self._reduce_dtype or (g.dtype if g is not None else p.dtype)

    def _submit(self, taken):
        """Reduce-scatters these taken (shard, gradient, dtype) as one group."""
        if not taken:
            return
        ins = [self._padded_grad(s, g, dtype) for s, g, dtype in taken]
        outs = [b.new_empty(s.shard) for b, (s, _, _) in zip(ins, taken)]
        # The k-th reduction of a parameter in a step has its own name: every rank
        # runs the same backward passes, so the names agree.
        names, seen = [], {}
        for s, _, _ in taken:
            k = len(self._pending.get(s.index, ())) + seen.get(s.index, 0)
            seen[s.index] = seen.get(s.index, 0) + 1
            names.append(f"zero.grad.{s.index}.{k}")
        # The runtime holds the inputs until their collective is done, then frees them.
        handles = mpi_ops._enqueue(_core.OP_REDUCESCATTER, ins, outs, names, mpi_ops.Average)
        for h, (s, _, _) in zip(handles, taken):
            self._pending.setdefault(s.index, []).append(h)

    def _on_grad_ready(self, p):
        if self._coalescing:
            return
        s = self._shard_of[p]
        self._delay[s.index] -= 1
        if self._delay[s.index] > 0:
            return
        self._delay[s.index] = self._bpps
        # Gradients wait in a bucket until it holds HOROVOD_ZERO_BUCKET_BYTES: one group
        # of several tensors fuses into one large collective instead of many small ones.
        taken = self._take(s, p)
        self._bucket.append(taken)
        self._bucket_bytes += s.padded * taken[2].itemsize
        if self._bucket_bytes >= self._bucket_limit:
            self._flush_bucket()

    def _flush_bucket(self):
        bucket, self._bucket, self._bucket_bytes = self._bucket, [], 0
        self._submit(bucket)

    def _trained(self):
        return [(s, p) for s, p in zip(self._shards, self._params) if p.requires_grad]

    def _submit_rest(self):
        # Every rank must submit every trained parameter, also those without a gradient
        # here; and gradient accumulated since a parameter's last reduction goes too.
        self._flush_bucket()
        self._submit([self._take(s, p) for s, p in self._trained() if s.index not in self._pending or p.grad is not None])

    def _finish_reduction(self):
        if self._reduced:
            return
        self._submit_rest()
        unscale = 1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0
        trained = self._trained()
        had = self._had_grad_anywhere(trained)
        for (s, _), flag in zip(trained, had):
            outs = [mpi_ops.synchronize(h) for h in self._pending[s.index]]  # one per reduction this step
            if not flag:
                # No rank had a gradient: grad None, so the inner optimizer skips the parameter
                # (no weight decay, no momentum) exactly as torch would.
                self._master_params[s.index].grad = None
                continue
            g = outs[0].float()  # the fp32 shard; no copy when the reduction already was fp32
            for o in outs[1:]:
                g.add_(o)
            if unscale != 1.0:
                g.mul_(unscale)  # in fp32: the scaled fp16 values are exact, the unscaled ones may not be
            self._master_params[s.index].grad = g
        self._pending.clear()
        self._had_grad.clear()
        self._delay = [self._bpps] * len(self._shards)
        self._reduced = True

    def _had_grad_anywhere(self, trained):
        """Per trained parameter, whether any rank had a gradient for it this step."""
        if not trained:
            return []
        # Small per-step allreduces stay on the parameters' device: on GPUs that is NCCL,
        # not Gloo's TCP pairs (~1 ms an op on an 8-GPU host).
        had = torch.tensor([1.0 if self._had_grad.get(s.index) else 0.0 for s, _ in trained], device=self._device)
        return [f > 0 for f in mpi_ops.allreduce(had, op=mpi_ops.Max, name="zero.had_grad").tolist()]

    def _grads(self):
        return [mp.grad for mp in self._master_params if mp.grad is not None]

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """Backward passes inside accumulate locally; each parameter is reduced once,
        on exit. Full gradients are held until then."""
        if self._coalescing:
            raise RuntimeError("coalesce_grad_reduction() blocks do not nest.")
        self._coalescing = True
        try:
            yield
        finally:
            self._coalescing = False
        self._submit_rest()

    # --- the step ----------------------------------------------------------

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clips the global gradient norm (over every rank's shards) like
        torch.nn.utils.clip_grad_norm_, and returns it."""
        if float(norm_type) != 2.0:
            raise ValueError("clip_grad_norm_ supports norm_type=2 only.")
        self._finish_reduction()
        grads = self._grads()
        local = torch.zeros(1, dtype=torch.float64, device=self._device)
        if grads:
            local += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        total = mpi_ops.allreduce(local, op=mpi_ops.Sum, name="zero.grad_norm").sqrt()[0]
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return total.float()

    def step(self, closure=None):
        if self._coalescing:
            raise RuntimeError("step() inside coalesce_grad_reduction(): gradients of that block are reduced "
                               "when it exits. Call step() after the with-block.")
        self._check_unchanged()
        self._finish_reduction()
        self._reduced = False
        self.wait_for_params()  # the inner step writes the master shards a gather may still read
        if self.loss_scaler is not None:
            found_inf = self._found_inf()
            self.loss_scaler.update(found_inf)
            if found_inf:  # every rank skips: the weights stay as they are
                return None
        loss = self.optimizer.step(closure)
        self._gather_params(wait=not self._overlap)
        return loss

    def _check_unchanged(self):
        guard.check_groups(self.optimizer.param_groups, self._master_params, len(self._plan))
        guard.check_storage(self._shards, self._params, self._stores)
        guard.check_slots(self._slots)

    @property
    def _step_supports_amp_scaling(self):
        # torch.amp.GradScaler.step() reads this first: the earliest place to refuse it.
        raise RuntimeError(guard.GRAD_SCALER)

    def scale_loss(self, loss):
        """loss * the current loss scale (unchanged without loss scaling)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def _found_inf(self):
        grads = self._grads()
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        local = (~finite).float().reshape(1).to(self._device)
        return bool(mpi_ops.allreduce(local, op=mpi_ops.Max, name="zero.found_inf").item())

    def _gather_params(self, wait=True):
        """Allgathers the master shards into the parameters. wait=False leaves the
        handles for wait_for_params() (the forward hooks, or the next step)."""
        self.wait_for_params()
        downcast = os.environ.get(_DOWNCAST_ENV, "1") != "0"
        by_dtype = {}
        for s, store in zip(self._shards, self._stores):
            by_dtype.setdefault(store.dtype, []).append(s)
        for dtype, shards in by_dtype.items():
            ins = [self._master_params[s.index] for s in shards]
            if downcast:
                outs = [self._stores[s.index] for s in shards]
                out_dtype = dtype
            else:  # gather fp32 and cast afterwards, to compare bytes and time
                outs = [torch.empty(s.padded, dtype=torch.float32, device=self._device) for s in shards]
                self._after_gather.update({s.index: (self._stores[s.index], o) for s, o in zip(shards, outs)})
                out_dtype = None
            names = [f"zero.param.{s.index}" for s in shards]
            handles = mpi_ops._enqueue(_core.OP_ALLGATHER, [i.detach() for i in ins], outs, names,
                                       output_dtype=out_dtype)
            self._gathering.update({s.index: h for s, h in zip(shards, handles)})
        if wait:
            self.wait_for_params()

    def wait_for_params(self, indices=None):
        """Waits until the parameters hold the values of the last step (all of them, or
        the shards at `indices`). Only needed with overlap_param_gather=True, before
        reading parameters outside the model's forward or state_dict()."""
        for i in list(self._gathering) if indices is None else indices:
            h = self._gathering.pop(i, None)
            if h is None:
                continue
            mpi_ops.synchronize(h)
            if i in self._after_gather:
                store, full = self._after_gather.pop(i)
                store.copy_(full)

    def zero_grad(self, set_to_none=True):
        """Frees the gradients: the full ones on the model and the fp32 shards."""
        for p in self._params:
            p.grad = None
        for mp in self._master_params:
            mp.grad = None

    # --- state -------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        """This rank's shard: its master weights and inner optimizer state."""
        self.wait_for_params()
        return {"zero": {"world_size": self._size, "rank": self._rank, "stage": self.stage,
                         "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                         "optimizer": compat.describe(self.optimizer, self._plan, self._names is not None)},
                "master": [m.detach().clone() for m in self._master],
                "inner": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        meta = state.get("zero", {})
        if meta.get("world_size") != self._size or meta.get("rank") != self._rank:
            raise ValueError(
                f"This state dict is rank {meta.get('rank')}'s shard of a job of size {meta.get('world_size')}; "
                f"this is rank {self._rank} of {self._size}. To change the world size, save with "
                "hvd.zero.save_checkpoint (or consolidated_state_dict) and load with hvd.zero.load_checkpoint.")
        saved = meta.get("optimizer") or compat.positional(self._plan)
        inner = state["inner"]
        compat.check_class(saved, inner["param_groups"], inner["state"], self.optimizer)
        order = compat.match_groups(saved, self._plan)  # saved group index per group here
        with torch.no_grad():
            for g, i in enumerate(order):
                compat.relay_master(self._master[g], self._plan[g], saved["groups"][i], state["master"][i])
        self.optimizer.load_state_dict(compat.reorder_inner(inner, order, saved, self._plan))
        if self.loss_scaler is not None and meta.get("loss_scaler"):
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        self._gather_params()

    def __repr__(self):
        return f"DistributedZeroOptimizer(stage={self.stage}, size={self._size}, inner={self.optimizer!r})"
