"""The horovod_zero PyTorch API: ``import horovod_zero.torch as hvd``."""

from horovod_zero.torch.basics import (
    ccl_built,
    collective_stats,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    device,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    runtime_info,
    shutdown,
    size,
)
from horovod_zero.torch.compression import Compression
from horovod_zero.torch.job import add_process_set, init, remove_process_set
from horovod_zero.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from horovod_zero.torch.mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from horovod_zero.torch.optimizer import DistributedOptimizer
from horovod_zero.torch.process_sets import ProcessSet, global_process_set
from horovod_zero.torch.sparse import sparse_allreduce_async
from horovod_zero.torch.sync_batch_norm import SyncBatchNorm
from horovod_zero.torch.alltoall import alltoall, alltoall_async
from horovod_zero.torch.join import join
from horovod_zero.torch.timeline import start_timeline, stop_timeline
from horovod_zero.torch import zero
from horovod_zero.torch import elastic
from horovod_zero.torch.zero import DistributedZeroOptimizer
