"""DistributedZeroOptimizer's arguments, checked in one place before anything changes
(nothing is sharded, moved or registered until every one is accepted): a frozen
value the parts read their settings from."""

from dataclasses import dataclass
from typing import Any, Optional

import torch

_NONE = (None, "none")


@dataclass(frozen=True)
class ZeroOptions:
    stage: int
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    backward_passes_per_step: int
    loss_scaling: bool             # fp16: scale the loss, skip steps that overflow on any rank
    overlap_param_gather: bool
    cast_forward_inputs: bool
    units: Any                     # module classes or instances (stage3 / overlap_param_gather), or None
    reshard_after_forward: bool
    reshard_root_after_forward: bool
    offload_optimizer: Optional[str]  # None, "cpu" or "nvme"
    nvme_path: Optional[str]
    offload_params: bool           # stage 3 parameter shards at rest in host memory
    overlap_step: bool
    shard_group: Optional[str]     # None (every rank of the scope) or "node" (hybrid sharding)
    process_set: Any               # hvd.ProcessSet, or None for every rank
    device: Any                    # device= as given (None: where the parameters are)
    init_fn: Any = None            # a model on the meta device: called with each module to initialise it

    @classmethod
    def check(cls, *, has_model, stage, param_dtype, reduce_dtype, backward_passes_per_step, loss_scaling,
              overlap_param_gather, cast_forward_inputs, units, reshard_after_forward, reshard_root_after_forward,
              offload_optimizer, nvme_path, offload_params, overlap_step, shard_group, process_set, device,
              init_fn=None):
        _check_stage(stage, has_model, units, overlap_param_gather, overlap_step)
        optimizer, params = _check_offload(offload_optimizer, nvme_path, offload_params, overlap_step, stage,
                                           loss_scaling, overlap_param_gather)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be 1 or more.")
        if overlap_param_gather and not has_model:
            raise ValueError("overlap_param_gather=True needs model=: the model's forward hooks wait for the gather.")
        if shard_group not in (None, "world", "node"):
            raise ValueError(f"shard_group={shard_group!r}: use None (shard over every rank) or 'node' (shard "
                             "within each node, replicate across nodes).")
        if process_set is not None and shard_group == "node":
            raise ValueError("process_set= with shard_group='node' is not supported: hybrid sharding spans the job.")
        if init_fn is not None and not callable(init_fn):
            raise ValueError(f"init_fn={init_fn!r} is not callable: pass a function of one module.")
        return cls(stage, param_dtype, reduce_dtype, backward_passes_per_step, loss_scaling,
                   bool(overlap_param_gather), bool(cast_forward_inputs), units, bool(reshard_after_forward),
                   bool(reshard_root_after_forward), optimizer, nvme_path, params, bool(overlap_step),
                   None if shard_group == "world" else shard_group, process_set, device, init_fn)

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer is not None

    def master_device(self, param_device):
        return torch.device("cpu") if self.offloaded else param_device


def _check_stage(stage, has_model, units, overlap_param_gather, overlap_step):
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r}: DistributedZeroOptimizer supports ZeRO stages 1, 2 and 3.")
    if stage == 3 and not has_model:
        raise ValueError("stage=3 needs model=: the model's forward hooks gather each unit's parameters.")
    if stage == 3 and overlap_param_gather and not overlap_step:
        raise ValueError("overlap_param_gather=True is for stages 1 and 2, and at stage 3 for offload with "
                         "overlap_step=True (the host step then ends under the next forward); stage 3 always "
                         "gathers ahead (HOROVOD_ZERO_PREFETCH units, default 1).")
    if stage != 3 and units is not None and not overlap_param_gather:
        raise ValueError(f"units= is for stage=3 and overlap_param_gather=True; at stage={stage} every parameter "
                         "is always whole.")


def _check_offload(offload_optimizer, nvme_path, offload_params, overlap_step, stage, loss_scaling,
                   overlap_param_gather):
    """The offload arguments: (offload_optimizer as None, "cpu" or "nvme"; offload_params as a bool)."""
    if offload_optimizer not in _NONE + ("cpu", "nvme"):
        raise ValueError(f"offload_optimizer={offload_optimizer!r}: use None, 'cpu' (pinned host memory) or "
                         "'nvme' (files under nvme_path).")
    if offload_params not in _NONE + ("cpu",):
        raise ValueError(f"offload_params={offload_params!r}: use None or 'cpu'.")
    optimizer = None if offload_optimizer in _NONE else offload_optimizer
    params = offload_params == "cpu"
    if optimizer == "nvme" and not nvme_path:
        raise ValueError("offload_optimizer='nvme' needs nvme_path=: a directory on a local disk (NVMe) "
                         "for the optimizer state files.")
    if nvme_path and optimizer != "nvme":
        raise ValueError(f"nvme_path={nvme_path!r} is only used with offload_optimizer='nvme'.")
    if params and stage != 3:
        raise ValueError(f"offload_params='cpu' is for stage=3; at stage={stage} every rank keeps whole "
                         "parameters on its device.")
    if params and optimizer is None:
        raise ValueError("offload_params='cpu' needs offload_optimizer='cpu' or 'nvme': the parameter shards "
                         "at rest are the host step's output.")
    if overlap_step:
        if optimizer is None and stage == 3 and overlap_param_gather:
            raise ValueError("overlap_param_gather=True at stage 3 is for offload (the host step then ends under "
                             "the next forward); on the device, overlap_step=True steps during backward and stage 3 "
                             "always gathers ahead. Leave overlap_param_gather=False.")
        if stage == 1:
            raise ValueError("overlap_step=True needs stage=2 or 3: at stage 1 gradients are reduced at step().")
        if optimizer == "nvme":
            raise ValueError("overlap_step=True is for offload_optimizer='cpu': with 'nvme' the state is read "
                             "and written in sub-groups at step().")
        if loss_scaling:
            raise ValueError("overlap_step=True cannot be used with loss scaling (fp16): an overflow is known "
                             "only once every gradient is in. Use bf16, or overlap_step=False.")
    if optimizer is not None and overlap_param_gather and not overlap_step:
        raise ValueError("overlap_param_gather=True with offload_optimizer needs overlap_step=True: the host "
                         "step then ends under the next forward, each module (stage 3: each gather) waiting "
                         "for its own parameters.")
    return optimizer, params
