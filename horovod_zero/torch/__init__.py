"""The horovod_zero PyTorch API: ``import horovod_zero.torch as hvd``."""

from horovod_zero.torch.basics import (
    collective_stats,
    cross_rank,
    cross_size,
    cuda_built,
    device,
    gloo_built,
    init,
    is_initialized,
    local_rank,
    local_size,
    nccl_built,
    rank,
    runtime_info,
    shutdown,
    size,
)
from horovod_zero.torch.functions import broadcast_object, broadcast_parameters
from horovod_zero.torch.mpi_ops import (
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
from horovod_zero.torch.alltoall import alltoall, alltoall_async
from horovod_zero.torch.join import join
from horovod_zero.torch import zero
from horovod_zero.torch.zero import DistributedZeroOptimizer
