"""ZeRO sharded data parallelism: ``hvd.DistributedZeroOptimizer`` and
``hvd.zero.{save_checkpoint, async_save_checkpoint, load_checkpoint, consolidated_state_dict,
load_consolidated, save_model, load_model}``."""

from horovod_zero.torch.zero.state.checkpoint import async_save_checkpoint, load_checkpoint, save_checkpoint
from horovod_zero.torch.zero.state.consolidated import consolidated_state_dict, load_consolidated
from horovod_zero.torch.zero.state.export import load_model, save_model
from horovod_zero.torch.zero.core.loss_scale import LossScaler
from horovod_zero.torch.zero.optimizer import DistributedZeroOptimizer

__all__ = ["DistributedZeroOptimizer", "LossScaler", "consolidated_state_dict", "load_consolidated", "save_checkpoint",
           "async_save_checkpoint", "load_checkpoint", "save_model", "load_model"]
