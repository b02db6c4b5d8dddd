"""What Horovod allows and we used to refuse, over 2 and 3 CPU ranks against plain
torch: op=Average and prescale/postscale factors on integer tensors (the double
product truncated toward zero, as Horovod's scaling does), hvd.Product, and int16
tensors (moved, not reduced)."""

import pytest
import torch

import horovod_zero.torch as hvd
from refs import make, scatter_slice

INTS = ["int32", "int64", "int8", "uint8"]


def _ints(rank, shape, dtype_name, seed):
    """Small integers, negative ones too (not for uint8), so sums truncate both ways."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    low = 0 if dtype_name == "uint8" else -9
    return torch.randint(low, 10, shape, generator=g).to(getattr(torch, dtype_name))


def _scaled(x, scale):
    """What one integer scaling does: x * scale in double, truncated toward zero."""
    return (x.double() * scale).trunc().long()


def _average_and_scales(dtype_name, seed):
    n, r = hvd.size(), hvd.rank()
    shape = (5, 3)
    inputs = [_ints(q, shape, dtype_name, seed) for q in range(n)]
    total = torch.stack([t.long() for t in inputs]).sum(0)
    dt = getattr(torch, dtype_name)
    tag = f"{dtype_name}.{seed}"

    avg = hvd.allreduce(inputs[r], op=hvd.Average, name=f"int.avg.{tag}")
    assert avg.dtype == dt
    assert torch.equal(avg.long(), torch.div(total, n, rounding_mode="trunc")), (avg, total)

    mine = inputs[r].clone()
    hvd.allreduce_(mine, op=hvd.Average, name=f"int.avg_.{tag}")
    assert torch.equal(mine, avg)

    pre, post = (0.5, 3.0) if dtype_name != "uint8" else (1.5, 0.5)
    scaled = hvd.allreduce(inputs[r], op=hvd.Sum, prescale_factor=pre, postscale_factor=post, name=f"int.scale.{tag}")
    presummed = torch.stack([_scaled(t, pre) for t in inputs]).sum(0)
    assert torch.equal(scaled.long(), _scaled(presummed, post)), (scaled, presummed)

    # Average with a postscale: one scaling by postscale / size, as Horovod.
    avg_post = hvd.allreduce(inputs[r], op=hvd.Average, postscale_factor=2.0, name=f"int.avgpost.{tag}")
    assert torch.equal(avg_post.long(), _scaled(total, 2.0 / n))

    # Fused: several integer tensors through one buffer.
    group = [_ints(r, (k + 2,), dtype_name, seed + k) for k in range(3)]
    outs = hvd.grouped_allreduce(group, op=hvd.Average, name=f"int.group.{tag}")
    for k, out in enumerate(outs):
        s = torch.stack([_ints(q, (k + 2,), dtype_name, seed + k).long() for q in range(n)]).sum(0)
        assert torch.equal(out.long(), torch.div(s, n, rounding_mode="trunc")), k

    rows = 2 * n + 1
    big = [_ints(q, (rows, 2), dtype_name, seed + 9) for q in range(n)]
    rs = hvd.reducescatter(big[r], op=hvd.Average, name=f"int.rs.{tag}")
    want = torch.div(torch.stack([t.long() for t in big]).sum(0), n, rounding_mode="trunc")
    assert torch.equal(rs.long(), scatter_slice(want, n, r))
    return True


@pytest.mark.parametrize("dtype_name", INTS)
def test_integer_average_and_scale_factors_truncate_like_horovod(ranks_fusion, dtype_name):
    assert all(ranks_fusion.run(_average_and_scales, dtype_name, 1))


def _product(dtype_name):
    n, r = hvd.size(), hvd.rank()
    dt = getattr(torch, dtype_name)
    if dt.is_floating_point:
        inputs = [make(q, (4, 3), dtype_name, 5) for q in range(n)]
        ref = torch.stack([t.double() for t in inputs]).prod(0)
        tol = {"float16": 1e-2, "bfloat16": 5e-2}.get(dtype_name, 1e-6)
        check = lambda out, want: torch.allclose(out.double(), want, rtol=tol, atol=tol)  # noqa: E731
    else:
        inputs = [_ints(q, (4, 3), dtype_name, 5).clamp(-3, 3) for q in range(n)]
        ref = torch.stack([t.long() for t in inputs]).prod(0)
        check = lambda out, want: torch.equal(out.long(), want)  # noqa: E731
    out = hvd.allreduce(inputs[r], op=hvd.Product, name=f"prod.{dtype_name}")
    assert out.dtype == dt and check(out, ref), (out, ref)
    outs = hvd.grouped_allreduce([inputs[r], inputs[r][:2]], op=hvd.Product, name=f"prod.group.{dtype_name}")
    assert check(outs[0], ref) and check(outs[1], ref[:2])
    rs = hvd.reducescatter(inputs[r], op=hvd.Product, name=f"prod.rs.{dtype_name}")
    assert check(rs, scatter_slice(ref, n, r))
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8"])
def test_product(ranks_fusion, dtype_name):
    assert all(ranks_fusion.run(_product, dtype_name))


def _int16():
    n, r = hvd.size(), hvd.rank()
    inputs = [make(q, (q + 1, 3), "int16", 6) * 1000 for q in range(n)]  # beyond int8's range
    gathered = hvd.allgather(inputs[r], name="i16.gather")
    assert gathered.dtype == torch.int16 and torch.equal(gathered, torch.cat(inputs))
    outs = hvd.grouped_allgather([inputs[r], inputs[r][:1]], name="i16.gather.group")
    assert torch.equal(outs[0], torch.cat(inputs)) and torch.equal(outs[1], torch.cat([t[:1] for t in inputs]))
    b = hvd.broadcast(inputs[r][:1].clone(), root_rank=n - 1, name="i16.bcast")
    assert torch.equal(b, inputs[n - 1][:1])
    mine = inputs[r][:1].clone()
    hvd.broadcast_(mine, root_rank=0, name="i16.bcast_")
    assert torch.equal(mine, inputs[0][:1])
    refused = {}
    for key, call in {
        "allreduce": lambda: hvd.allreduce(inputs[r], name="i16.ar"),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(n, dtype=torch.int16), name="i16.rs"),
    }.items():
        try:
            call()
            refused[key] = None
        except ValueError as e:
            refused[key] = str(e)
    return refused


def test_int16_is_moved_but_not_reduced(ranks_fusion):
    for refused in ranks_fusion.run(_int16):
        for key, msg in refused.items():
            assert msg is not None and "int16" in msg and "tensor.int()" in msg, (key, msg)
