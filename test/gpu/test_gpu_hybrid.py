"""Hybrid sharding (shard_group="node") on CUDA over NCCL: the CPU test's jobs with
each simulated node given its own GPUs through CUDA_VISIBLE_DEVICES, as on real
nodes (2 GPUs: 2 nodes of 1; 4 GPUs: 2 nodes of 2). Every rank matches the
single-process reference, and per step only the allreduce of its gradient shards
is counted in the cross-node set."""

import functools

import pytest

import test_zero_hybrid as cpu
from harness import launch, on_gpus

pytestmark = pytest.mark.gpu
NODES = 2


def _gpu_node_env(rank, local):
    env = cpu._node_env(rank, NODES, local)
    node = rank // local
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * local + i) for i in range(local))
    return env


@pytest.mark.parametrize("size", on_gpus(2, 4))
@pytest.mark.parametrize("stage,clip,offload", [(1, None, False), (2, 0.05, False), (3, None, False),
                                                (2, None, True)],
                         ids=["stage1", "stage2-clip", "stage3", "stage2-offload"])
def test_hybrid_sharding_on_cuda_matches_reference_and_only_shards_cross_nodes(size, stage, clip, offload):
    local = size // NODES
    res = launch(cpu._hybrid, size, stage, clip, offload, "cuda", env=functools.partial(_gpu_node_env, local=local),
                 timeout=240)
    cpu.check_hybrid(res, size, local)
