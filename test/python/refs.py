"""Deterministic per-rank inputs and tolerances shared by the op tests: every rank
can rebuild every other rank's input, so references are computed with plain torch
in the test itself."""

import torch

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8"]
FLOATS = ["float32", "float64", "float16", "bfloat16"]


def dtype(name):
    return getattr(torch, name)


def make(rank, shape, dtype_name, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    dt = dtype(dtype_name)
    if dt.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    elif dt == torch.uint8:
        t = torch.randint(0, 20, shape, generator=g).to(dt)
    else:
        t = torch.randint(-20, 20, shape, generator=g).to(dt)
    return t.to(device)


def tol(dtype_name):
    return {
        "float32": dict(rtol=1e-5, atol=1e-5),
        "float64": dict(rtol=1e-12, atol=1e-12),
        "float16": dict(rtol=5e-3, atol=5e-3),
        "bfloat16": dict(rtol=3e-2, atol=3e-2),
    }.get(dtype_name, dict(rtol=0, atol=0))


def reduce_ref(tensors, op_name):
    """The reduction every rank should see, computed in float64 (or exactly for ints)."""
    stacked = torch.stack([t.double() if t.dtype.is_floating_point else t.long() for t in tensors])
    if op_name == "Sum":
        return stacked.sum(0)
    if op_name == "Average":
        return stacked.sum(0) / len(tensors)
    if op_name == "Min":
        return stacked.min(0).values
    return stacked.max(0).values


def scatter_rows(dim0, size, rank):
    return dim0 // size + (1 if rank < dim0 % size else 0)


def scatter_slice(t, size, rank):
    start = sum(scatter_rows(t.shape[0], size, k) for k in range(rank))
    return t[start:start + scatter_rows(t.shape[0], size, rank)]
