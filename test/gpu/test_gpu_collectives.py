"""alltoall, join, Product, integer Average and scales, and int16 over NCCL on 1
and 2 GPUs, against plain-torch references."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import on_gpus, shared_pool
from refs import make

pytestmark = pytest.mark.gpu


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


def _alltoall(dtype_name):
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    matrix = [[0] * n] + [[(q + k) % 3 for k in range(n)] for q in range(1, n)]  # empty parts, an empty input
    inputs = [make(q, (sum(matrix[q]), 3), dtype_name, 21) for q in range(n)]
    out, received = hvd.alltoall(inputs[r].to(dev), splits=matrix[r], name=f"g.a2a.{dtype_name}")
    want = torch.cat([inputs[q][sum(matrix[q][:r]):sum(matrix[q][:r + 1])] for q in range(n)])
    assert out.is_cuda and torch.equal(out.cpu(), want)
    assert received.tolist() == [matrix[q][r] for q in range(n)]
    even = hvd.alltoall(make(r, (2 * n,), dtype_name, 22).to(dev), name=f"g.a2a.even.{dtype_name}")
    assert torch.equal(even.cpu(), torch.cat([make(q, (2 * n,), dtype_name, 22)[2 * r:2 * r + 2] for q in range(n)]))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "int16", "uint8"])
def test_cuda_alltoall(gpus, dtype_name):
    gpus.run(_alltoall, dtype_name)


def _join():
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    outs = []
    for i in range(r + 1):  # the last rank runs most steps
        s = hvd.allreduce(torch.full((5,), float(r + 1), device=dev), op=hvd.Sum, name="g.join.sum")
        a = hvd.allreduce(torch.full((5,), float(r + 1), device=dev), op=hvd.Average, name="g.join.avg")
        outs.append((s.cpu()[0].item(), a.cpu()[0].item()))
    return outs, hvd.join()


def test_cuda_join_adds_zeros(gpus):
    results = gpus.run(_join)
    n = len(results)
    for r, (outs, last) in enumerate(results):
        assert last == n - 1
        for i, (s, a) in enumerate(outs):
            total = float(sum(q + 1 for q in range(n) if q >= i))
            assert (s, a) == (total, total / n), (r, i, s, a)


def _int_and_product():
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    ints = [torch.arange(-7, 8, dtype=torch.int64) * (q + 1) for q in range(n)]
    total = torch.stack(ints).sum(0)
    avg = hvd.allreduce(ints[r].to(dev), op=hvd.Average, name="g.int.avg")
    assert torch.equal(avg.cpu(), torch.div(total, n, rounding_mode="trunc"))
    scaled = hvd.allreduce(ints[r].int().to(dev), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                           name="g.int.scale")
    pre = torch.stack([(t.double() * 0.5).trunc() for t in ints]).sum(0)
    assert torch.equal(scaled.cpu().long(), (pre * 3.0).trunc().long())
    floats = [make(q, (6, 2), "float32", 23) for q in range(n)]
    prod = hvd.allreduce(floats[r].to(dev), op=hvd.Product, name="g.prod")
    torch.testing.assert_close(prod.cpu().double(), torch.stack([t.double() for t in floats]).prod(0),
                               rtol=1e-5, atol=1e-5)
    small = [(t % 4).int() for t in ints]
    iprod = hvd.allreduce(small[r].to(dev), op=hvd.Product, name="g.iprod")
    assert torch.equal(iprod.cpu().long(), torch.stack([t.long() for t in small]).prod(0))
    i16 = [make(q, (q + 1, 4), "int16", 24) * 1000 for q in range(n)]
    gathered = hvd.allgather(i16[r].to(dev), name="g.i16.gather")
    assert torch.equal(gathered.cpu(), torch.cat(i16))
    b = hvd.broadcast(i16[r][:1].to(dev), root_rank=n - 1, name="g.i16.bcast")
    assert torch.equal(b.cpu(), i16[n - 1][:1])
    return True


def test_cuda_integer_average_scales_product_and_int16(gpus):
    assert all(gpus.run(_int_and_product))
