"""DistributedZeroOptimizer: the wrapper that composes ZeRO's parts. It checks its
arguments (options.py), picks a step strategy (the device's, core/step.py, or the
host's, offload/host_step.py) and a way the parameters are held (whole at stages 1
and 2, core/params.py; gathered unit by unit at stage 3, stage3/hooks.py), and passes
the collaborators each part needs to its constructor (core/protocols.py).

[Note: where each tensor lives]
- Storage (core/storage.py): each model parameter's storage is a zero-padded flat
  buffer of size * shard elements (in param_dtype); the parameter is a view of its
  first numel elements. This rank's fp32 master shards of one param group live in one
  flat buffer; the inner optimizer steps views of it (any torch.optim optimizer).
- Reduction (core/reduce.py): gradients are reduce-scattered (op=Average) from a
  zero-padded copy of the full gradient: stage 2 as each gradient becomes ready in
  backward (then the full gradient is freed), stage 1 when the step (or a
  coalescing block) needs them. The fp32 gradient shards the inner optimizer reads
  exist only from the reduction to zero_grad(): forward and backward, where
  activations peak, run without them (as FSDP2's sharded gradients).
- Gathering (core/gather.py): after the inner step the updated fp32 master shards are
  allgathered straight into the parameters' buffers with output_dtype=param_dtype,
  so the downcast happens in the runtime's copy-in and param_dtype crosses the wire.
  With overlap_param_gather=True, step() returns once the allgather is queued; each
  unit's forward pre-hook waits for the parameters under it (core/params.py), so the
  gather of later layers runs under the compute of earlier ones. With offload and
  overlap_step, step() returns before the CPU step ends (offload/overlap.py).
- Because the parameters are views of those buffers, changes to the model after
  wrapping that replace them would silently stop training: step() checks for
  them first, and the model's forward pre-hook checks one parameter (wrap/guard.py).
"""

import logging
import weakref

import torch

from horovod_zero.torch import basics
from horovod_zero.torch.zero import hybrid
from horovod_zero.torch.zero.config import ZeroConfig
from horovod_zero.torch.zero.core.early_step import EarlyStep
from horovod_zero.torch.zero.core.loss_scale import LossScaler
from horovod_zero.torch.zero.core.params import WholeParams, wait_for_params
from horovod_zero.torch.zero.core.reduce import GradReducer
from horovod_zero.torch.zero.core.step import DeviceStep
from horovod_zero.torch.zero.core.storage import ShardedStorage
from horovod_zero.torch.zero.core.tuning import ZeroTuning
from horovod_zero.torch.zero.core.units import find_units, wait_units
from horovod_zero.torch.zero.core.weak import weak_hook
from horovod_zero.torch.zero.offload.host_step import HostStep
from horovod_zero.torch.zero.options import ZeroOptions
from horovod_zero.torch.zero.stage3.hooks import Stage3
from horovod_zero.torch.zero.state import full_state, rank_state
from horovod_zero.torch.zero.state.view import ShardedStateView
from horovod_zero.torch.zero.wrap import guard, meta_init, placement
from horovod_zero.torch.zero.wrap.cast import cast_floating
from horovod_zero.torch.zero.wrap.init_state import created_state, holds_constructor_state
from horovod_zero.torch.zero.wrap.names import check_in_model, check_names, name_map


def _remove_all(handles):
    for h in handles:
        h.remove()


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
                 reshard_root_after_forward=False, device=None, init_fn=None):
        self._build(optimizer, model, None, named_parameters, stage, param_dtype, reduce_dtype,
                    backward_passes_per_step, loss_scaler, overlap_param_gather, cast_forward_inputs, units,
                    reshard_after_forward, offload_optimizer, nvme_path, offload_params, overlap_step, shard_group,
                    process_set, reshard_root_after_forward, device, init_fn)

    def _build(self, optimizer, model, keep, named_parameters, stage, param_dtype, reduce_dtype,
               backward_passes_per_step, loss_scaler, overlap_param_gather, cast_forward_inputs, units,
               reshard_after_forward, offload_optimizer, nvme_path, offload_params, overlap_step, shard_group,
               process_set, reshard_root_after_forward, device, init_fn):
        """The constructor's work, and _rejoin()'s; `keep`: the ShardGroups whose collectives'
        tag to keep (hybrid.shard_groups), None for the job's next one."""
        if loss_scaler is None and param_dtype == torch.float16:
            loss_scaler = LossScaler()
        named_parameters = list(named_parameters) if named_parameters is not None else None
        # What _rejoin() builds with again, in a job of another size (hvd.elastic).
        self._init_args = dict(
            named_parameters=named_parameters, stage=stage, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            backward_passes_per_step=backward_passes_per_step, loss_scaler=loss_scaler,
            overlap_param_gather=overlap_param_gather, cast_forward_inputs=cast_forward_inputs, units=units,
            reshard_after_forward=reshard_after_forward, offload_optimizer=offload_optimizer, nvme_path=nvme_path,
            offload_params=offload_params, overlap_step=overlap_step, shard_group=shard_group,
            process_set=process_set, reshard_root_after_forward=reshard_root_after_forward, device=device,
            init_fn=init_fn)
        options = ZeroOptions.check(
            has_model=model is not None, stage=stage, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            backward_passes_per_step=backward_passes_per_step, loss_scaling=loss_scaler is not None,
            overlap_param_gather=overlap_param_gather, cast_forward_inputs=cast_forward_inputs, units=units,
            reshard_after_forward=reshard_after_forward, reshard_root_after_forward=reshard_root_after_forward,
            offload_optimizer=offload_optimizer, nvme_path=nvme_path, offload_params=offload_params,
            overlap_step=overlap_step, shard_group=shard_group, process_set=process_set, device=device,
            init_fn=init_fn)
        self.options = options
        self.config = ZeroConfig.from_env()
        # Refused before anything changes.
        unit_modules = find_units(model, options.units) if options.stage == 3 else None
        forward_waits = (wait_units(model, options.units) if options.overlap_param_gather and options.stage < 3
                         else None)
        remake_state = holds_constructor_state(optimizer)
        self.optimizer = optimizer
        self.stage = options.stage
        self.loss_scaler = loss_scaler
        self.step_count = 0
        groups = hybrid.shard_groups(options.shard_group, options.process_set, keep)
        self._names = check_names(optimizer, model, named_parameters)
        self._model = weakref.ref(model) if model is not None else None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        on_meta = meta_init.is_meta(model, params)
        if on_meta and options.device is None:
            raise ValueError("The model is on the meta device: pass device= (hvd.device(), or 'cpu' on CPU ranks), "
                             "where it is made real, one unit at a time, and trains.")
        device = placement.resolve(options.device, params, model, self._names or {})
        # Makes a meta model real unit by unit, on `device`, as add_groups() shards it (only at construction).
        self._meta_batches = meta_init.MetaInit(model, options.units, options.init_fn, device) if on_meta \
            else None
        self._storage = ShardedStorage(groups, device, options.master_device(device), options.param_dtype,
                                       self.config.init_chunk_bytes, sharded_params=options.stage == 3)
        if options.offloaded:
            self._step = HostStep(options, self._storage, optimizer, self.config.downcast,
                                  logging.getLogger("horovod_zero").warning)
        elif options.overlap_step:
            self._step = EarlyStep(self._storage, optimizer, self.config.downcast, self.config.fused_step)
        else:
            self._step = DeviceStep(self._storage, optimizer, self.config.downcast, self.config.fused_step,
                                    self.config.step_chunk_bytes, self.config.master_adam)
        self._gatherer = self._step.gatherer
        tuning = ZeroTuning(self.config, options.stage, basics._runtime())
        self._reducer = GradReducer(self._storage, self._step.sink, options.stage >= 2,
                                    options.backward_passes_per_step, options.reduce_dtype, tuning.bucket_bytes, tuning)
        self._hooks = []
        weakref.finalize(self, _remove_all, self._hooks)  # hooks go when the optimizer goes
        self._cast_to = options.param_dtype if options.cast_forward_inputs else None
        if model is not None:  # before stage 3's hooks: the check of the storage runs first
            self._hooks.append(model.register_forward_pre_hook(weak_hook(self, "_before_forward"), with_kwargs=True))
        if options.stage == 3:
            self._params = Stage3(model, unit_modules, self._storage, self._gatherer, self._reducer,
                                  tuning, options.reshard_after_forward,
                                  options.reshard_root_after_forward)
        else:
            self._params = WholeParams(model, self._storage, self._gatherer, self._step, forward_waits)
        weakref.finalize(self, _remove_all, self._params.hooks)  # also those it adds later
        self._slots = []
        optimizer.state.clear()  # constructor state for the full parameters: made again for the shards below
        self._shard_groups(0)
        if options.device is not None and model is not None:  # after every refusal: a refused wrap moves nothing
            placement.move_rest(model, device)
        self._remake_state = remake_state
        if remake_state:
            optimizer.state.update(created_state(optimizer, optimizer.param_groups))
        if options.overlap_param_gather:
            # A state_dict() taken after step() must see the gathered values.
            self._hooks.append(model.register_state_dict_pre_hook(weak_hook(self, "_wait_all_hook")))
        self.sharded_state = ShardedStateView(self, self._storage, self._step, self._names is not None)

    @property
    def init_path(self):
        """How the shards were built: "device" (on the parameters' device directly), or
        "chunked (N elements)" when the device lacked the memory and each parameter was
        staged through the host (HOROVOD_ZERO_INIT_CHUNK_BYTES forces it)."""
        return self._storage.init_path

    # --- construction ------------------------------------------------------

    def _shard_groups(self, first):
        """Shards the param groups from `first` on, which still hold the model's own
        parameters, and hooks their parameters."""
        params = self._storage.add_groups(self.optimizer.param_groups[first:], first, self._names,
                                          self._meta_batches)
        self._meta_batches = None
        self._reducer.extend(len(params))
        if params:
            self._step.add_shards(self._storage.shards[-len(params):], self._storage.stores[-len(params):])
        model = self._model() if self._model is not None else None
        if model is not None:
            self._slots += guard.module_slots(model, params)
        self._params.on_new_params(params)
        if self.stage >= 2:
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(weak_hook(self, "_on_grad_ready")))

    def _rejoin(self):
        """hvd.elastic: after hvd.shutdown() and hvd.init() formed a new job (of any size),
        shards the same parameters for it, as the constructor did; the elastic state then
        loads the committed values (state/replicas.py). Nothing of the old job's runtime is
        waited for: its handles died with it. Collective, like the constructor."""
        _remove_all(self._hooks)
        _remove_all(self._params.hooks)
        model = self._model() if self._model is not None else None
        st = self._storage
        for group, shards in zip(self.optimizer.param_groups, st.plan):
            group["params"] = [st.params[s.index] for s in shards]
        self.optimizer.state.clear()
        args = dict(self._init_args)
        if self.stage == 3:  # the parameters hold no values at rest: made again unit by unit, as from meta
            args.update(device=st.param_device, init_fn=meta_init.to_meta(model, st.params, st.shards))
        # The same tag as before: a worker that joins names this optimizer by the order its
        # script builds optimizers, which this process followed too.
        self._build(self.optimizer, model, self._storage.groups, **args)

    def add_param_group(self, param_group):
        """Adds a param group, as torch.optim.Optimizer.add_param_group does, and shards
        it (its parameters start from rank 0's values). Every rank must call it with the
        same group, between steps: not after backward() and before step()."""
        if self._reducer.busy:
            raise RuntimeError("add_param_group() while gradients wait for step(): call it after step() and "
                               "zero_grad(), or before the first backward().")
        self.wait_for_params()
        self._step.check_add_group()
        group = dict(param_group)
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        self._check_new(params)
        self.optimizer.add_param_group({**group, "params": params})  # validates and fills in the defaults
        self._shard_groups(len(self.optimizer.param_groups) - 1)
        model = self._model() if self._model is not None else None
        if self.options.device is not None and model is not None:
            placement.move_rest(model, self._storage.param_device)  # the new modules' buffers
        if self._remake_state:
            self.optimizer.state.update(created_state(self.optimizer, self.optimizer.param_groups[-1:]))

    def _check_new(self, params):
        model = self._model() if self._model is not None else None
        if model is not None:
            self._names = name_map(model.named_parameters())  # the model may have gained modules
        if self._names is not None:
            check_in_model(params, self._names, len(self._storage.shards))
        shard_of = self._storage.shard_of
        seen = set()
        if any(p.is_meta for p in params):
            raise ValueError("add_param_group() with parameters on the meta device: only a model wrapped on the meta "
                             "device is made real; make these real first (to_empty() and their init).")
        for p in params:
            if p in shard_of or p in seen:
                name = shard_of[p].name if p in shard_of else (self._names or {}).get(p, "")
                raise ValueError(f"Parameter {name!r} (shape {tuple(p.shape)}) is already in a param group of "
                                 "this optimizer; a parameter can be in one group only.")
            seen.add(p)
        if self.options.device is not None:
            placement.check_crossing(params, self._storage.param_device, model, self._names or {})
        else:
            placement.one_device(params + self._storage.params[:1], self._storage.param_device)

    def _before_forward(self, module, args, kwargs):
        guard.check_storage(self._storage, self._params.forward_checks())
        if self._cast_to is None:
            return None
        return cast_floating(args, self._cast_to), cast_floating(kwargs, self._cast_to)

    def _wait_all_hook(self, *_):
        self.wait_for_params()

    # --- gradient reduction ----------------------------------------------

    def _on_grad_ready(self, p):
        self._reducer.on_grad_ready(p)

    def _finish_reduction(self):
        self._reducer.finish(1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0)

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
        self._step.check_clip()
        self._finish_reduction()
        return self._step.clip(max_norm, self._reducer.order_after)

    def step(self, closure=None):
        if self._reducer.coalescing:
            raise RuntimeError("step() inside coalesce_grad_reduction(): gradients of that block are reduced "
                               "when it exits. Call step() after the with-block.")
        self._check_unchanged()
        self._params.check_at_rest()
        # Before the reduction is taken: a call refused here changes nothing, so the step
        # can be called again once the cause is put right.
        self._step.check_step(closure)
        self._finish_reduction()
        self._reducer.hand_over()
        self._step.before_update()
        if self.loss_scaler is not None:
            found_inf = self._step.found_inf()
            self.loss_scaler.update(found_inf)
            if found_inf:  # every rank skips: the weights stay as they are
                self._step.skip()
                return None
        self.step_count += 1
        return self._step.step(closure, self._params, overlap=self.options.overlap_param_gather)

    def _check_unchanged(self):
        st = self._storage
        guard.check_groups(self.optimizer.param_groups, st.master_params, len(st.plan))
        guard.check_storage(st, range(len(st.shards)))
        guard.check_slots(self._slots)

    @property
    def _step_supports_amp_scaling(self):
        # torch.amp.GradScaler.step() reads this first: the earliest place to refuse it.
        raise RuntimeError(guard.GRAD_SCALER)

    def scale_loss(self, loss):
        """loss * the current loss scale (unchanged without loss scaling)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def publish_loaded(self):
        """After the master shards were rewritten in place (what load_state_dict and
        hvd.zero.load_checkpoint do): the parameters take their values. With offload the
        param_dtype copies are made from the masters first. Every rank must call it."""
        self.wait_for_params()  # a gather the stream only waited for may still read what a load rewrites
        self._step.refresh()
        self._params.publish(wait=True)

    def wait_for_params(self, indices=None):
        """Waits until the parameters hold the values of the last step (all of them, or
        the shards at `indices`). Only needed with overlap_param_gather=True, before
        reading parameters outside the model's forward or state_dict()."""
        wait_for_params(self._step, self._gatherer, indices)
        self._reducer.release()  # and report a reduction that failed after step() queued its use

    def gathered_params(self, rank0_only=False):
        """Stage 3: a context manager in which every parameter is whole (param_dtype), for
        evaluation or export (model.state_dict()); freed on exit. rank0_only=True keeps
        them on rank 0 only, gathering one parameter at a time, so the other ranks never
        hold the whole model. Every rank must enter it."""
        return self._params.gathered(rank0_only)

    def zero_grad(self, set_to_none=True):
        """Frees the gradients: the full ones on the model, those already being reduced
        (zero_grad() before step() drops them, as in torch) and the fp32 shards; at stage 3
        also the gathers a forward that raised left behind."""
        if self._reducer.coalescing:
            raise RuntimeError("zero_grad() inside coalesce_grad_reduction(): call it before the block or after step().")
        self._step.check_skip()
        self._reducer.discard()
        self._params.free()
        for p in self._storage.params:
            p.grad = None
        for mp in self._storage.master_params:
            mp.grad = None
        self._step.clear()
        self.sharded_state.loaded_full = None  # training began: no broadcast of a loaded full state comes

    # --- state -------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        """This rank's shard: its master weights and inner optimizer state."""
        return rank_state.save(self.sharded_state)

    def load_state_dict(self, state):
        """Loads what state_dict() returned on this rank (every rank calls it, each with its
        own), or a full optimizer state: a torch optimizer's state_dict() (parameters by
        position, as a plain optimizer or hvd.DistributedOptimizer saves it) or the
        'optimizer' of hvd.zero.consolidated_state_dict (by name). A full state is loaded
        locally, this rank taking its shard of it: load it on every rank, or on the root and
        then call hvd.broadcast_optimizer_state(opt, root_rank) on every rank. The optimizer
        keeps the full state (a reference, not a copy) for that broadcast until it runs or
        the next zero_grad()."""
        if full_state.is_rank_shard(state):
            rank_state.load(self.sharded_state, state)
        else:
            full_state.load(self.sharded_state, state)

    def offload_stats(self):
        """Bytes moved by offload since construction: "d2h_bytes" (gradient shards to the
        host), "h2d_bytes" (parameter shards back), "disk_read_bytes" and
        "disk_write_bytes" (NVMe); and "step" (which code steps the host shards).
        With overlap_step on the device: "stepped_early", the shards whose step was
        queued during backward since construction. Otherwise empty."""
        return self._step.stats()

    def __repr__(self):
        return f"DistributedZeroOptimizer(stage={self.stage}, size={self._storage.size}, inner={self.optimizer!r})"
