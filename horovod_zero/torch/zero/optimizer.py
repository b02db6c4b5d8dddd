"""DistributedZeroOptimizer: the wrapper that ties ZeRO's parts together.

[Note: where each tensor lives]
- Storage (storage.py): each model parameter's storage is a zero-padded flat buffer
  of size * shard elements (in param_dtype); the parameter is a view of its first
  numel elements. This rank's fp32 master shards of one param group live in one
  flat buffer; the inner optimizer steps views of it (any torch.optim optimizer).
- Reduction (reduce.py): gradients are reduce-scattered (op=Average) from a
  zero-padded copy of the full gradient: stage 2 as each gradient becomes ready in
  backward (then the full gradient is freed), stage 1 when the step (or a
  coalescing block) needs them. The fp32 gradient shards the inner optimizer reads
  exist only from the reduction to zero_grad(): forward and backward, where
  activations peak, run without them (as FSDP2's sharded gradients).
- Gathering (gather.py): after the inner step the updated fp32 master shards are
  allgathered straight into the parameters' buffers with output_dtype=param_dtype,
  so the downcast happens in the runtime's copy-in and param_dtype crosses the wire.
  With overlap_param_gather=True, step() returns once the allgather is queued; each
  unit's forward pre-hook waits for the parameters under it (units.py), so the gather
  of later layers runs under the compute of earlier ones. With offload and
  overlap_step, step() returns before the CPU step ends (offload/overlap.py).
- Because the parameters are views of those buffers, changes to the model after
  wrapping that replace them would silently stop training: step() checks for
  them first, and the model's forward pre-hook checks one parameter (guard.py).
"""

import contextlib
import logging
import weakref

import torch

from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import rank, size
from horovod_zero.torch.zero import compat, guard, hybrid, placement
from horovod_zero.torch.zero.cast import cast_floating
from horovod_zero.torch.zero.config import ZeroConfig
from horovod_zero.torch.zero.gather import ParamGatherer, hook_forward_waits
from horovod_zero.torch.zero.init_state import created_state, holds_constructor_state
from horovod_zero.torch.zero.loss_scale import LossScaler
from horovod_zero.torch.zero.names import check_in_model, check_names, name_map
from horovod_zero.torch.zero.offload.options import OffloadOptions
from horovod_zero.torch.zero.reduce import GradReducer
from horovod_zero.torch.zero.stage3 import Stage3
from horovod_zero.torch.zero.storage import ShardedStorage
from horovod_zero.torch.zero.units import find_units, wait_units
from horovod_zero.torch.zero.weak import weak_hook


def _remove_all(handles):
    for h in handles:
        h.remove()


def _check_stage_args(stage, model, units, overlap_param_gather, overlap_step):
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r}: DistributedZeroOptimizer supports ZeRO stages 1, 2 and 3.")
    if stage == 3 and model is None:
        raise ValueError("stage=3 needs model=: the model's forward hooks gather each unit's parameters.")
    if stage == 3 and overlap_param_gather and not overlap_step:
        raise ValueError("overlap_param_gather=True is for stages 1 and 2, and at stage 3 for offload with "
                         "overlap_step=True (the host step then ends under the next forward); stage 3 always "
                         "gathers ahead (HOROVOD_ZERO_PREFETCH units, default 1).")
    if stage != 3 and units is not None and not overlap_param_gather:
        raise ValueError(f"units= is for stage=3 and overlap_param_gather=True; at stage={stage} every parameter "
                         "is always whole.")


class DistributedZeroOptimizer:
    """Wraps a torch.optim optimizer with ZeRO sharding: stage 1 (optimizer state),
    2 (gradients too) or 3 (parameters too).

    Stage 3 needs model=. At rest each parameter is only this rank's fp32 master
    shard; gather units (each module of the model's largest nn.ModuleList, or
    units=[classes or modules]) are gathered in param_dtype just before their forward
    and again before their backward, and freed after (reshard_after_forward=False
    keeps them from forward to backward). Parameters outside every unit, or shared
    between units (the root's), stay gathered from the model's forward to the end of
    backward; reshard_root_after_forward=True frees them between the two, as FSDP2
    does for a root wrapped with reshard_after_forward=True, so that the loss is
    computed without them.
    Use `with opt.gathered_params():` to read whole parameters outside forward.

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

    device= trains the parameters on that device (default: the one they are on):
    build a model too large for the GPU in fp32 on the host and pass
    device=hvd.device(). Each parameter moves as it is sharded, and model='s buffers
    and frozen parameters move too.
    """

    def __init__(self, optimizer, model=None, named_parameters=None, stage=2, param_dtype=None,
                 reduce_dtype=None, backward_passes_per_step=1, loss_scaler=None, overlap_param_gather=False,
                 cast_forward_inputs=True, units=None, reshard_after_forward=True, offload_optimizer=None,
                 nvme_path=None, offload_params=None, overlap_step=False, shard_group=None, process_set=None,
                 reshard_root_after_forward=False, device=None):
        _check_stage_args(stage, model, units, overlap_param_gather, overlap_step)
        if loss_scaler is None and param_dtype == torch.float16:
            loss_scaler = LossScaler()
        offload = OffloadOptions.check(offload_optimizer, nvme_path, offload_params, overlap_step, stage,
                                       loss_scaler is not None, overlap_param_gather)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be 1 or more.")
        if overlap_param_gather and model is None:
            raise ValueError("overlap_param_gather=True needs model=: the model's forward hooks wait for the gather.")
        self.config = ZeroConfig.from_env()
        unit_modules = find_units(model, units) if stage == 3 else None  # refused before anything changes
        # overlap_param_gather: the modules whose forward waits for their parameters (all of their
        # subtree: a module may read a child's weights without calling it, as MultiheadAttention
        # does out_proj's); the root waits for the rest.
        self._wait_units = wait_units(model, units) if overlap_param_gather and stage < 3 else None
        remake_state = holds_constructor_state(optimizer)
        self.optimizer = optimizer
        self.stage = stage
        if shard_group not in (None, "world", "node"):
            raise ValueError(f"shard_group={shard_group!r}: use None (shard over every rank) or 'node' (shard "
                             "within each node, replicate across nodes).")
        if process_set is not None and shard_group == "node":
            raise ValueError("process_set= with shard_group='node' is not supported: hybrid sharding spans the job.")
        if shard_group == "node":
            groups = hybrid.node_sharding()
        else:
            groups = hybrid.set_sharding(process_set) if process_set is not None else hybrid.full_sharding()
        self._size, self._rank = groups.size, groups.rank
        self._names = check_names(optimizer, model, named_parameters)
        self._model = weakref.ref(model) if model is not None else None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._moves = device is not None  # device=: each parameter crosses as it is sharded
        device = placement.resolve(device, params, model, self._names or {})
        self._storage = ShardedStorage(self._rank, self._size, device, offload.master_device(device), param_dtype,
                                       self.config, sharded_params=stage == 3)
        self._storage.shard_set, self._storage.cross_set = groups.shard_set, groups.cross_set
        self._storage.scope = groups.scope
        self._reducer = GradReducer(self._storage, stage >= 2, backward_passes_per_step, reduce_dtype,
                                    self.config.bucket_bytes)
        self._gatherer = ParamGatherer(self._storage, self.config.downcast)
        self.loss_scaler = loss_scaler
        self._offload = offload.build(self._storage, optimizer, self._reducer, self._gatherer,
                                      logging.getLogger("horovod_zero").warning)
        self._hooks = []
        weakref.finalize(self, _remove_all, self._hooks)  # hooks go when the optimizer goes
        self._overlap = bool(overlap_param_gather)
        self._slots = []
        optimizer.state.clear()  # constructor state for the full parameters: made again for the shards below
        self._shard_groups(0)
        if self._moves and model is not None:  # after every refusal: a refused wrap moves nothing
            placement.move_rest(model, device)
        self._remake_state = remake_state
        if remake_state:
            optimizer.state.update(created_state(optimizer, optimizer.param_groups))
        if self._overlap:
            # A state_dict() taken after step() must see the gathered values.
            self._hooks.append(model.register_state_dict_pre_hook(self._weak("_wait_all_hook")))
        self._cast_to = param_dtype if cast_forward_inputs else None
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._weak("_before_forward"), with_kwargs=True))
        self._stage3 = None
        if stage == 3:  # its hooks run after _before_forward's check of the parameters' storage
            self._stage3 = Stage3(model, unit_modules, self._storage, self._gatherer, self._reducer,
                                  self.config.prefetch, reshard_after_forward, reshard_root_after_forward)
            self._hooks += self._stage3.hooks

    # What the checkpoint code and tests read.
    _shards = property(lambda self: self._storage.shards)
    _params = property(lambda self: self._storage.params)
    _plan = property(lambda self: self._storage.plan)
    _master = property(lambda self: self._storage.master)
    _master_params = property(lambda self: self._storage.master_params)
    _device = property(lambda self: self._storage.param_device)
    _gathering = property(lambda self: self._gatherer.in_flight)
    init_path = property(lambda self: self._storage.init_path)

    # --- construction ------------------------------------------------------

    def _shard_groups(self, first):
        """Shards the param groups from `first` on, which still hold the model's own
        parameters, and hooks their parameters."""
        params = self._storage.add_groups(self.optimizer.param_groups[first:], first, self._names)
        self._reducer.extend(len(params))
        if self._offload is not None and params:
            self._offload.add_shards(self._storage.shards[-len(params):], self._storage.stores[-len(params):])
        model = self._model() if self._model is not None else None
        if model is not None:
            self._slots += guard.module_slots(model, params)
        if self._overlap and model is not None and self.stage < 3:  # stage 3's gathers wait (Offload.before_gather)
            self._hooks += hook_forward_waits(model, self._wait_units, set(params), self._storage.shard_of,
                                              self._weak)
        if self.stage >= 2:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._weak("_on_grad_ready")))

    def add_param_group(self, param_group):
        """Adds a param group, as torch.optim.Optimizer.add_param_group does, and shards
        it (its parameters start from rank 0's values). Every rank must call it with the
        same group, between steps: not after backward() and before step()."""
        if self._reducer.busy:
            raise RuntimeError("add_param_group() while gradients wait for step(): call it after step() and "
                               "zero_grad(), or before the first backward().")
        self.wait_for_params()
        if self._offload is not None:
            self._offload.check_add_group()
        group = dict(param_group)
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        self._check_new(params)
        self.optimizer.add_param_group({**group, "params": params})  # validates and fills in the defaults
        self._shard_groups(len(self.optimizer.param_groups) - 1)
        model = self._model() if self._model is not None else None
        if self._moves and model is not None:
            placement.move_rest(model, self._device)  # the new modules' buffers
        if self._stage3 is not None:
            self._stage3.assign()
        if self._remake_state:
            self.optimizer.state.update(created_state(self.optimizer, self.optimizer.param_groups[-1:]))

    def _check_new(self, params):
        model = self._model() if self._model is not None else None
        if model is not None:
            self._names = name_map(model.named_parameters())  # the model may have gained modules
        if self._names is not None:
            check_in_model(params, self._names, len(self._shards))
        seen = set()
        for p in params:
            if p in self._storage.shard_of or p in seen:
                name = self._storage.shard_of[p].name if p in self._storage.shard_of else (self._names or {}).get(p, "")
                raise ValueError(f"Parameter {name!r} (shape {tuple(p.shape)}) is already in a param group of "
                                 "this optimizer; a parameter can be in one group only.")
            seen.add(p)
        if self._moves:
            placement.check_crossing(params, self._device, model, self._names or {})
        else:
            placement.one_device(params + self._params[:1], self._device)

    def _weak(self, method, *bound):
        return weak_hook(self, method, *bound)

    def _before_forward(self, module, args, kwargs):
        # One parameter's storage, O(1) a forward: model.float()/.half()/.to() after wrapping
        # replace every parameter's, and the forward would run on weights that never update.
        # At stage 3 every one: the gather would otherwise repair the storage of some and hide it.
        guard.check_storage(self._storage, range(len(self._shards) if self._stage3 else min(1, len(self._shards))))
        if self._cast_to is None:
            return None
        return cast_floating(args, self._cast_to), cast_floating(kwargs, self._cast_to)

    def _wait_all_hook(self, *_):
        self.wait_for_params()

    def _wait_hook(self, indices, module, args):
        if self._offload is not None:
            self._offload.params_ready(indices)  # stepped, copied back and (by the worker) gathered
            self._gatherer.wait(indices, stream_ordered=True)  # released by the next wait_for_params()
        elif self._gatherer.in_flight:
            self._gatherer.wait(indices)

    # --- gradient reduction ----------------------------------------------

    def _on_grad_ready(self, p):
        self._reducer.on_grad_ready(p)

    def _finish_reduction(self):
        self._reducer.finish(1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0)

    def _grads(self):
        return [mp.grad for mp in self._master_params if mp.grad is not None]

    def coalesce_grad_reduction(self):
        """Backward passes inside accumulate locally; each parameter is reduced once,
        on exit. Full gradients are held until then."""
        return self._reducer.coalesce()

    # --- the step ----------------------------------------------------------

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clips the global gradient norm (over every rank's shards) like
        torch.nn.utils.clip_grad_norm_, and returns it."""
        if float(norm_type) != 2.0:
            raise ValueError("clip_grad_norm_ supports norm_type=2 only.")
        if self._offload is not None:
            self._offload.check_clip()
        self._finish_reduction()
        if self._offload is not None:
            return self._offload.clip(max_norm)
        grads = self._grads()
        local = torch.zeros(1, dtype=torch.float64, device=self._device)
        if grads:
            local += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        # Over the ranks holding one copy of every shard (all of them, or one node's).
        total = mpi_ops.allreduce(local, op=mpi_ops.Sum, name="zero.grad_norm",
                                  process_set=self._storage.shard_set).sqrt()[0]
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return total.float()

    def step(self, closure=None):
        if self._reducer.coalescing:
            raise RuntimeError("step() inside coalesce_grad_reduction(): gradients of that block are reduced "
                               "when it exits. Call step() after the with-block.")
        self._check_unchanged()
        if self._stage3 is not None:
            self._stage3.check_at_rest()
        if self._offload is not None:
            # Before the reduction is taken: a call refused here changes nothing, so the step
            # can be called again once the cause is put right.
            self._offload.check_step(closure)
        self._finish_reduction()
        self._reducer.reduced = False
        self.wait_for_params()  # the inner step writes the master shards a gather may still read
        if self.loss_scaler is not None:
            found_inf = self._found_inf()
            self.loss_scaler.update(found_inf)
            if found_inf:  # every rank skips: the weights stay as they are
                if self._offload is not None:
                    self._offload.skip()
                return None
        if self._offload is not None:
            every = range(len(self._shards))
            if self._overlap:
                self._offload.step_deferred(every)  # each unit's forward (stage 3: each gather) waits for its own
            elif self._stage3 is not None:
                self._offload.step(every)
            else:
                self._offload.step(every, gather=self._gatherer.gather)
                self.wait_for_params()
            if self._stage3 is not None:
                self._stage3.reshard_all()  # the next forward gathers the new values
            return None
        loss = self.optimizer.step(closure)
        self._gather_params(wait=not self._overlap)
        return loss

    def _check_unchanged(self):
        guard.check_groups(self.optimizer.param_groups, self._master_params, len(self._plan))
        guard.check_storage(self._storage, range(len(self._shards)))
        guard.check_slots(self._slots)

    @property
    def _step_supports_amp_scaling(self):
        # torch.amp.GradScaler.step() reads this first: the earliest place to refuse it.
        raise RuntimeError(guard.GRAD_SCALER)

    def scale_loss(self, loss):
        """loss * the current loss scale (unchanged without loss scaling)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def _found_inf(self):
        if self._offload is not None:
            return self._offload.host.found_inf()
        grads = self._grads()
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        local = (~finite).float().reshape(1).to(self._device)
        return bool(mpi_ops.allreduce(local, op=mpi_ops.Max, name="zero.found_inf",
                                      process_set=self._storage.scope.process_set).item())

    def _gather_params(self, wait=True):
        """Allgathers the master shards into the parameters. wait=False leaves the
        handles for wait_for_params() (the forward hooks, or the next step). At stage 3
        the parameters are freed instead: the next forward gathers the new values.
        With offload (after a load: an offloaded step gathers its own output) the
        param_dtype copies are made from the masters first."""
        self.wait_for_params()  # a gather the stream only waited for may still read what a load rewrites
        if self._offload is not None:
            self._offload.host.refresh(range(len(self._shards)))
        if self._stage3 is not None:
            self._stage3.reshard_all()
            return
        self._gatherer.gather(range(len(self._shards)))
        if wait:
            self.wait_for_params()

    def wait_for_params(self, indices=None):
        """Waits until the parameters hold the values of the last step (all of them, or
        the shards at `indices`). Only needed with overlap_param_gather=True, before
        reading parameters outside the model's forward or state_dict()."""
        if self._offload is not None and self._offload.deferred:  # the host step's end
            self._offload.params_ready(indices)
        self._gatherer.wait(indices)
        self._gatherer.release(indices)  # stage 3: gathers the compute stream only waited for

    def gathered_params(self, rank0_only=False):
        """Stage 3: a context manager in which every parameter is whole (param_dtype), for
        evaluation or export (model.state_dict()); freed on exit. rank0_only=True keeps
        them on rank 0 only, gathering one parameter at a time, so the other ranks never
        hold the whole model. Every rank must enter it."""
        if self._stage3 is None:
            raise ValueError("gathered_params() is for stage=3; at stages 1 and 2 the parameters are always whole.")
        return self._stage3.gathered(rank0_only and self._rank != 0)

    def zero_grad(self, set_to_none=True):
        """Frees the gradients: the full ones on the model, those already being reduced
        (zero_grad() before step() drops them, as in torch) and the fp32 shards; at stage 3
        also the gathers a forward that raised left behind."""
        if self._reducer.coalescing:
            raise RuntimeError("zero_grad() inside coalesce_grad_reduction(): call it before the block or after step().")
        if self._offload is not None:
            self._offload.check_skip()
        self._reducer.discard()
        if self._stage3 is not None:
            self._stage3.reshard_all()
        for p in self._params:
            p.grad = None
        for mp in self._master_params:
            mp.grad = None
        if self._offload is not None:
            self._offload.clear()

    # --- state -------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _materialized(self, write_back=False):
        """With NVMe offload the master shards and optimizer state are on disk: this block
        has them in memory (and writes them back after it if write_back). With
        overlap_param_gather the host step of the last step may still be writing them:
        it ends first."""
        if self._offload is not None:
            self._offload.check_between_steps()
        self.wait_for_params()
        return self._offload.materialized(write_back) if self._offload is not None else contextlib.nullcontext()

    def state_dict(self):
        """This rank's shard: its master weights and inner optimizer state."""
        with self._materialized():
            out = self._state_dict()
        return out

    def _state_dict(self):
        inner = self.optimizer.state_dict()
        if self._offload is not None and self._offload.nvme is not None:
            # Copies, not views of the flat buffers read from disk: those are freed after
            # this, and a saved view would carry its whole buffer.
            inner["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                              for k, st in inner["state"].items()}
        return {"zero": {"world_size": self._size, "rank": self._rank, "stage": self.stage,
                         "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                         "optimizer": compat.describe(self.optimizer, self._plan, self._names is not None)},
                "master": [m.detach().clone() for m in self._master],
                "inner": inner}

    def load_state_dict(self, state):
        with self._materialized(write_back=True):
            self._load_state_dict(state)

    def _load_state_dict(self, state):
        self.wait_for_params()  # no gather may still read the shards this rewrites
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

    def offload_stats(self):
        """Bytes moved by offload since construction: "d2h_bytes" (gradient shards to the
        host), "h2d_bytes" (parameter shards back), "disk_read_bytes" and
        "disk_write_bytes" (NVMe); and "step" (which code steps the host shards).
        Empty without offload."""
        return self._offload.stats() if self._offload is not None else {}

    def __repr__(self):
        return f"DistributedZeroOptimizer(stage={self.stage}, size={self._size}, inner={self.optimizer!r})"
