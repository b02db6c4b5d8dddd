"""Process sets over NCCL, against plain-torch references: a communicator per set,
split from the global one when that exists as the set is added (ncclCommSplit),
else made on the set's first CUDA op (ncclCommInitRank over the set's control
plane); every set's kernels on the device's one collective stream. With 2 GPUs the
sets are single ranks beside the global set; with 4 they also overlap ({0,1},
{1,2}, {2,3}) and run at once, with the same tensor names in every set."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import on_gpus, shared_pool
from refs import assert_close, make, reduce_ref, scatter_slice

pytestmark = pytest.mark.gpu

DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def _pool(n, how):
    # A pool per way the communicators are made: "init" must see no global CUDA op before its sets'.
    return shared_pool(n, env={**DYNAMIC, "HVDZ_TEST_NCCL_COMMS": how})


def _sets_for(n):
    singles = [[k] for k in range(n)]
    return singles + ([[k, k + 1] for k in range(n - 1)] if n > 2 else [])


def _ops_in_sets(split):
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    assert dev.type == "cuda"
    if split:  # the global communicator exists before the sets: theirs are split from it
        assert hvd.allreduce(torch.ones(1, device=dev), op=hvd.Sum, name="warm").item() == n
    sets = [hvd.add_process_set(ranks) for ranks in _sets_for(n)]
    try:
        mine = [ps for ps in sets if ps.included()]
        every = {k: make(k, (6, 5), "float32", 11) for k in range(n)}
        handles = []
        for ps in mine:  # all in flight together, the same name in every set
            handles.append(("sum", ps, hvd.allreduce_async(every[r].to(dev), op=hvd.Sum, name="t", process_set=ps)))
            handles.append(("gather", ps, hvd.allgather_async(every[r].to(dev), name="g", process_set=ps)))
        handles.append(("sum", hvd.global_process_set, hvd.allreduce_async(every[r].to(dev), op=hvd.Sum, name="t")))
        for kind, ps, h in handles:
            out = hvd.synchronize(h)
            assert out.is_cuda
            ins = [every[k] for k in ps.ranks]
            if kind == "sum":
                assert_close(out, reduce_ref(ins, "Sum").float(), "float32")
            else:
                assert torch.equal(out.cpu(), torch.cat(ins))
        for ps in mine:
            rs = hvd.reducescatter(every[r].to(dev), op=hvd.Average, name="rs", process_set=ps)
            ref = scatter_slice(reduce_ref([every[k] for k in ps.ranks], "Average"), ps.size(), ps.rank()).float()
            assert_close(rs, ref, "float32")
            root = ps.ranks[-1]
            assert torch.equal(hvd.broadcast(every[r].to(dev), root_rank=root, name="b", process_set=ps).cpu(),
                               every[root])
        hvd.barrier()
        return len(mine)
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


@pytest.fixture(params=on_gpus(2, 4))
def gpus(request):
    return request.param


@pytest.mark.parametrize("how", ["split", "init"])
def test_sets_over_nccl_match_torch(gpus, how):
    counts = _pool(gpus, how).run(_ops_in_sets, how == "split")
    assert counts == [len([s for s in _sets_for(gpus) if k in s]) for k in range(gpus)]


def _optimizer_per_pair():
    """Two data-parallel replicas of two GPUs each, as in hybrid sharding's replica sets."""
    dev, r = hvd.device(), hvd.rank()
    low, high = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])  # every rank adds both, in one order
    pair = low if r < 2 else high
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(dev)
        ref = torch.nn.Linear(8, 4)
        ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=pair)
        model(make(r, (16, 8), "float32", 3).to(dev)).pow(2).sum().backward()
        opt.step()
        grads = []
        for k in pair.ranks:
            ref.zero_grad()
            ref(make(k, (16, 8), "float32", 3)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for p, *gs in zip(ref.parameters(), *grads):
                p -= 0.1 * sum(gs) / len(gs)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.detach().cpu(), q.detach(), "float32")
        hvd.barrier()
    finally:
        hvd.remove_process_set(low)
        hvd.remove_process_set(high)


@pytest.mark.gpus(4)
def test_distributed_optimizer_per_replica_pair():
    _pool(4, "split").run(_optimizer_per_pair)
