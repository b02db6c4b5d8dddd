"""The offload arguments of DistributedZeroOptimizer, checked before anything
changes: offload_optimizer ("cpu" or "nvme"), nvme_path, offload_params ("cpu",
stage 3) and overlap_step."""

from dataclasses import dataclass
from typing import Optional

import torch

_NONE = (None, "none")


@dataclass(frozen=True)
class OffloadOptions:
    optimizer: Optional[str]   # None, "cpu" or "nvme"
    nvme_path: Optional[str]
    params: bool               # stage 3 parameter shards at rest in host memory
    overlap_step: bool
    overlap_param_gather: bool  # with overlap_step: step() returns before the host step ends

    @classmethod
    def check(cls, offload_optimizer, nvme_path, offload_params, overlap_step, stage, loss_scaling,
              overlap_param_gather):
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
            if optimizer is None:
                raise ValueError("overlap_step=True overlaps the host step with backward: it needs "
                                 "offload_optimizer='cpu' or 'nvme'.")
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
        return cls(optimizer, nvme_path, params, bool(overlap_step), bool(overlap_param_gather and optimizer))

    def master_device(self, param_device):
        return torch.device("cpu") if self.optimizer is not None else param_device

    def build(self, storage, optimizer, reducer, gatherer, log):
        if self.optimizer is None:
            return None
        from horovod_zero.torch.zero.offload.engine import Offload
        return Offload(self, storage, optimizer, reducer, gatherer, log)
