"""ZeRO sharded data parallelism: ``hvd.DistributedZeroOptimizer`` and
``hvd.zero.{consolidated_state_dict, load_consolidated, save_checkpoint, load_checkpoint, save_model,
load_model}``."""

from horovod_zero.torch.zero.state.checkpoint import (
    consolidated_state_dict,
    load_checkpoint,
    load_consolidated,
    save_checkpoint,
)
from horovod_zero.torch.zero.state.export import load_model, save_model
from horovod_zero.torch.zero.core.loss_scale import LossScaler
from horovod_zero.torch.zero.optimizer import DistributedZeroOptimizer

__all__ = ["DistributedZeroOptimizer", "LossScaler", "consolidated_state_dict", "load_consolidated", "save_checkpoint",
           "load_checkpoint", "save_model", "load_model"]
