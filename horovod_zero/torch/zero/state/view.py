"""The optimizer's sharded state as checkpoints and export read it: a small, read-only
view (opt.sharded_state), so that the state code depends on this interface rather
than on the optimizer's private fields.

What a rank holds: for each parameter the optimizer trains (in the optimizer's order,
`shards[i]` and `masters[i]`), its fp32 master shard: elements
[rank * shard, (rank + 1) * shard) of the flattened parameter, zero-padded at the end
(core/plan.py ParamShard). The inner optimizer's state is keyed by those master
shards and shaped like them."""

import weakref
from typing import List, Optional

import torch

from horovod_zero.torch.zero.core.plan import ParamShard


class ShardedStateView:
    def __init__(self, opt, storage, step, named):
        # The optimizer owns this view: a weak reference, so that dropping the optimizer frees it
        # (and removes its hooks) at once rather than at the next cycle collection.
        self._opt = weakref.ref(opt)  # its inner optimizer, loss_scaler, step_count, and publishing
        self._storage = storage
        self._step = step
        self.named = named       # whether shard names are the model's (else param.0, param.1, ...)
        self.on_disk = step.state_on_disk  # NVMe offload: materialized() reads masters and state from disk
        self.stage = opt.stage
        self.rank = storage.rank  # this rank's place among the ranks that split each parameter
        self.size = storage.size  # how many ranks split each parameter
        self.shard_set = storage.groups.shard_set  # the set whose ranks hold one copy of every shard (None: all)
        self.scope = storage.groups.scope  # every rank of the optimizer, and its first (which writes files)
        self.device = storage.param_device
        # The optimizer's DCP save still writing in the background (sharded_checkpoint.py), or None:
        # the next save or load finishes it first.
        self.pending_save = None
        # A full optimizer state this rank loaded with opt.load_state_dict() (state/full_state.py), and
        # the step count then, until hvd.broadcast_optimizer_state() gives it to the other ranks.
        self.loaded_full = None

    @property
    def shards(self) -> List[ParamShard]:
        """Every trained parameter's shard layout, by shard index."""
        return self._storage.shards

    @property
    def groups(self) -> List[List[ParamShard]]:
        """The shards of each param group, in the inner optimizer's group order."""
        return self._storage.plan

    @property
    def masters(self) -> List[torch.nn.Parameter]:
        """This rank's fp32 master shards, by shard index (what the inner optimizer steps)."""
        return self._storage.master_params

    @property
    def flat_masters(self) -> List[torch.Tensor]:
        """Per param group: the flat buffer the master shards are views of."""
        return self._storage.master

    @property
    def params(self) -> List[torch.nn.Parameter]:
        """The model's parameters, by shard index."""
        return self._storage.params

    @property
    def model(self) -> Optional[torch.nn.Module]:
        """The model= the optimizer was given (None without one)."""
        ref = self._opt()._model
        return ref() if ref is not None else None

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (its state is keyed by `masters`)."""
        return self._opt().optimizer

    @property
    def loss_scaler(self):
        return self._opt().loss_scaler

    @property
    def step_count(self) -> int:
        """Steps applied (skipped ones not counted), also across checkpoints."""
        return self._opt().step_count

    def set_step_count(self, n: Optional[int]) -> None:
        """After a load: the step count the state was saved at (None: not saved, left as is)."""
        if n is not None:
            self._opt().step_count = int(n)

    def materialized(self, write_back: bool = False):
        """A block in which `masters` and the inner optimizer's state are in memory (NVMe
        offload keeps them on disk) and no step is half done; with write_back, what the
        block changed is written back after it."""
        self._step.check_between_steps()
        self._opt().wait_for_params()
        return self._step.materialized(write_back)

    def publish(self) -> None:
        """After the masters were loaded: the parameters take their values."""
        self._opt().publish_loaded()
