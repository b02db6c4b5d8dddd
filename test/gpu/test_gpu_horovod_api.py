"""The GPU side of Horovod's torch API, on CUDA tensors over NCCL, each against plain
torch on every rank: hvd.SyncBatchNorm, alltoall with splits, a model split over two GPUs
of each process, broadcast_optimizer_state, and the errors for a tensor that is on the CPU
on one rank and on a GPU on another, and for one grouped op over two GPUs or over the host and a
GPU."""

import pytest
import torch

import horovod_zero.torch as hvd
import sync_bn_check
from harness import RankPool, on_gpus, shared_pool

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(2))
def gpus(request):
    return shared_pool(request.param)


def test_sync_batch_norm_on_cuda_matches_batch_norm_over_the_whole_batch(gpus):
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        for errs, eval_err, tracked in gpus.run(sync_bn_check.run, "cuda", dtype):
            for dx, dw, stats, y in errs:
                assert max(dx, dw, stats, y) < tol, (dtype, errs)
            assert eval_err < tol and tracked == 2


def _rows(src, n):
    """Rank src's input: src + q + 1 rows for each rank q, in rank order."""
    return torch.arange(sum(src + q + 1 for q in range(n)) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * src


def _alltoall_with_splits():
    r, n = hvd.rank(), hvd.size()
    splits = [r + q + 1 for q in range(n)]
    out, received = hvd.alltoall(_rows(r, n).to(hvd.device()), splits=torch.tensor(splits), name="api.a2a")
    # Reference: from each source, the slice of its rows addressed to this rank.
    ref = torch.cat([_rows(src, n)[sum(src + q + 1 for q in range(r)):][:src + r + 1] for src in range(n)])
    return out.device.type, torch.equal(out.cpu(), ref), received.tolist(), [src + r + 1 for src in range(n)]


def test_alltoall_with_splits_on_cuda(gpus):
    for kind, equal, received, expected in gpus.run(_alltoall_with_splits):
        assert kind == "cuda" and equal
        assert received == expected


def _second_gpu():
    """Another GPU than hvd.device(), and never another rank's first: with 2 GPUs per
    rank, rank r holds cuda:r and cuda:r+n; on 2 GPUs, ranks 0 and 1 swap them."""
    n, count = hvd.size(), torch.cuda.device_count()
    return torch.device("cuda", (hvd.device().index + (n if count >= 2 * n else 1)) % count)


def _split_model(seed, first, second):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 8).to(first), torch.nn.Linear(8, 3).to(second)


def _loss(a, b, x, y):
    return torch.nn.functional.mse_loss(b(torch.tanh(a(x.to(a.weight.device))).to(b.weight.device)),
                                        y.to(b.weight.device))


def _batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + rank)  # drawn in fp32 for every dtype: the same values
    return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)


def _model_parallel(groups):
    """Two layers on two GPUs of each process, Horovod's DistributedOptimizer over them
    (groups=1: one group over both GPUs), against the same steps in fp64 on the CPU over
    every rank's batch."""
    r, n = hvd.rank(), hvd.size()
    first, second = hvd.device(), _second_gpu()
    a, b = _split_model(r, first, second)  # every rank starts elsewhere: the broadcast matters
    named = [("a." + k, p) for k, p in a.named_parameters()] + [("b." + k, p) for k, p in b.named_parameters()]
    hvd.broadcast_parameters(dict(named), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.5), named_parameters=named,
                                   groups=groups)
    ra, rb = (m.double() for m in _split_model(0, "cpu", "cpu"))
    ref_opt = torch.optim.SGD(list(ra.parameters()) + list(rb.parameters()), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        _loss(a, b, *_batch(r, step)).backward()
        opt.step()
        ref_opt.zero_grad()
        # Horovod averages the ranks' gradients: the mean of the ranks' losses.
        (sum(_loss(ra, rb, *_batch(q, step, torch.float64)) for q in range(n)) / n).backward()
        ref_opt.step()
    err = max((p.detach().cpu().double() - q.detach()).abs().max().item()
              for p, q in zip(list(a.parameters()) + list(b.parameters()), list(ra.parameters()) + list(rb.parameters())))
    return str(a.weight.device), str(b.weight.device), err


@pytest.mark.parametrize("groups", [None, 1])
def test_a_model_split_over_two_gpus_of_each_process_trains_as_one(gpus, groups):
    rows = gpus.run(_model_parallel, groups)
    for da, db, err in rows:
        assert da != db, rows
        assert err < 1e-5, rows


def _join_beside_a_model_split():
    """Rank 0 allreduces on both its GPUs while the others have joined: they stand in with
    zeros on GPUs of their own that rank 0 does not use there (runtime/device_maps.h)."""
    r = hvd.rank()
    if r != 0:
        return None, hvd.join()
    outs = [hvd.allreduce(torch.full((3,), 2.0, device=d), op=hvd.Sum, name=f"api.join.{d.index}").cpu().tolist()
            for d in (hvd.device(), _second_gpu())]
    return outs, hvd.join()


@pytest.mark.parametrize("size", on_gpus(2))
def test_joined_ranks_stand_in_beside_a_model_split(size):
    # Fresh ranks, so that no device map of an earlier test serves the joined rank.
    pool = RankPool(size)
    try:
        rows = pool.run(_join_beside_a_model_split)
    finally:
        pool.close()
    assert rows[0][0] == [[2.0] * 3, [2.0] * 3], rows
    assert all(last == 0 for _, last in rows), rows


def _grouped_over_two_gpus():
    ts = [torch.ones(2, device=hvd.device()), torch.ones(2, device=_second_gpu())]
    try:
        hvd.grouped_allreduce(ts, name="api.two_gpus")
    except ValueError as e:
        return str(e)
    return None


def test_one_grouped_op_over_two_gpus_is_refused_clearly(gpus):
    for msg in gpus.run(_grouped_over_two_gpus):
        assert msg is not None and "Group the tensors of each device separately" in msg, msg


def _grouped_over_host_and_gpu():
    ts = [torch.ones(2), torch.ones(2, device=hvd.device())]
    try:
        hvd.grouped_allreduce(ts, name="api.host_and_gpu")
    except ValueError as e:
        msg = str(e)
    else:
        msg = None
    # Nothing was enqueued: the runtime still works.
    ok = torch.equal(hvd.allreduce(torch.ones(2, device=hvd.device()), op=hvd.Sum, name="api.after_mixed").cpu(),
                     torch.full((2,), float(hvd.size())))
    return msg, ok


def test_one_grouped_op_over_the_host_and_a_gpu_is_refused_clearly(gpus):
    for msg, ok in gpus.run(_grouped_over_host_and_gpu):
        assert msg is not None and "Group the tensors of each device separately" in msg and "cpu" in msg, msg
        assert ok


def _broadcast_optimizer_state():
    r = hvd.rank()
    dev = hvd.device()
    torch.manual_seed(r)  # every rank starts elsewhere
    model = torch.nn.Linear(6, 3).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    model(torch.randn(4, 6, device=dev)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = [(k, v.cpu() if torch.is_tensor(v) else v) for s in opt.state.values() for k, v in sorted(s.items())]
    rows = hvd.allgather_object((opt.param_groups[0]["lr"], state))
    same = all(lr == rows[0][0] and all(k == k0 and (torch.equal(torch.as_tensor(v), torch.as_tensor(v0)))
                                        for (k, v), (k0, v0) in zip(st, rows[0][1]))
               for lr, st in rows)
    on_gpu = all(v.device.type == "cuda" for s in opt.state.values() for k, v in s.items()
                 if torch.is_tensor(v) and k != "step")
    return same, rows[0][0], on_gpu


def test_broadcast_optimizer_state_on_cuda(gpus):
    for same, lr, on_gpu in gpus.run(_broadcast_optimizer_state):
        assert same and lr == 0.01 and on_gpu


def _cpu_here_cuda_there():
    t = torch.ones(4) if hvd.rank() == 0 else torch.ones(4, device=hvd.device())
    try:
        hvd.allreduce(t, name="api.mixed")
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return None


def test_a_tensor_on_the_cpu_on_one_rank_and_a_gpu_on_another_is_refused(gpus):
    for msg in gpus.run(_cpu_here_cuda_there):
        assert msg is not None and "Mismatched device kind for tensor 'api.mixed'" in msg, msg
        assert "rank 0 has cpu, rank 1 has cuda" in msg, msg
