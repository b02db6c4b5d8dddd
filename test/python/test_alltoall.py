"""hvd.alltoall over 2 and 3 CPU ranks (Gloo) against a reference built from every
rank's input: even splits, uneven splits, empty parts and empty inputs, every
dtype, Horovod's return values, autograd, splits that change under one name, and
the errors."""

import pytest
import torch

import horovod_zero.torch as hvd
from refs import DTYPES, make

ALL_DTYPES = DTYPES + ["int16"]


def _matrix(n, case, step=0):
    """splits[q][r]: rows rank q sends to rank r."""
    if case == "even":
        return [[2] * n for _ in range(n)]
    if case == "uneven":
        return [[(q + 2 * r + step) % 3 + 1 for r in range(n)] for q in range(n)]
    # "empty": rank 0 sends nothing (its input has no rows), the others leave some parts empty.
    return [[0] * n] + [[(q + r) % 3 for r in range(n)] for q in range(1, n)]


def _expected(inputs, matrix, me):
    parts = []
    for q, t in enumerate(inputs):
        first = sum(matrix[q][:me])
        parts.append(t[first:first + matrix[q][me]])
    return torch.cat(parts)


def _inputs(matrix, dtype_name, trailing, seed):
    return [make(q, (sum(matrix[q]),) + trailing, dtype_name, seed) for q in range(len(matrix))]


def _alltoall(dtype_name, case, trailing):
    n, r = hvd.size(), hvd.rank()
    matrix = _matrix(n, case)
    inputs = _inputs(matrix, dtype_name, trailing, 7)
    name = f"a2a.{dtype_name}.{case}.{len(trailing)}"
    if case == "even":
        out = hvd.alltoall(inputs[r], name=name)  # without splits: the output alone
        received = None
    else:
        out, received = hvd.alltoall(inputs[r], splits=matrix[r], name=name)
    want = _expected(inputs, matrix, r)
    assert out.dtype == want.dtype and out.shape == want.shape, (out.shape, want.shape)
    assert torch.equal(out, want)
    if received is not None:
        assert received.dtype == torch.int32 and received.device.type == "cpu"
        assert received.tolist() == [matrix[q][r] for q in range(n)]


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
def test_alltoall_uneven_splits_every_dtype(ranks, dtype_name):
    ranks.run(_alltoall, dtype_name, "uneven", (3,))


@pytest.mark.parametrize("case", ["even", "uneven", "empty"])
@pytest.mark.parametrize("trailing", [(), (2, 3)], ids=["1d", "3d"])
def test_alltoall_splits(ranks, case, trailing):
    ranks.run(_alltoall, "float32", case, trailing)


def _return_values():
    n, r = hvd.size(), hvd.rank()
    matrix = _matrix(n, "uneven")
    inputs = _inputs(matrix, "float64", (2,), 8)
    want = _expected(inputs, matrix, r)
    recv = [matrix[q][r] for q in range(n)]
    # A splits tensor: the received splits take its dtype.
    out, received = hvd.alltoall(inputs[r], splits=torch.tensor(matrix[r], dtype=torch.int64), name="rv.tensor")
    assert torch.equal(out, want) and received.dtype == torch.int64 and received.tolist() == recv
    # Async: synchronize returns (output, received_splits), with or without splits, as in Horovod.
    even = make(r, (2 * n, 2), "float32", 9)
    h = hvd.alltoall_async(even, name="rv.async")
    out, received = hvd.synchronize(h)
    assert torch.equal(out, _expected([make(q, (2 * n, 2), "float32", 9) for q in range(n)], _matrix(n, "even"), r))
    assert received.tolist() == [2] * n
    h = hvd.alltoall_async(inputs[r], splits=matrix[r], name="rv.async.splits")
    assert isinstance(h, int)
    pair = hvd.synchronize(h)
    assert isinstance(pair, tuple) and torch.equal(pair[0], want) and pair[1].tolist() == recv
    # Grouped waits return one pair per alltoall.
    hs = [hvd.alltoall_async(inputs[r], splits=matrix[r], name=f"rv.many.{i}") for i in range(2)]
    pairs = hvd.synchronize(hs)
    assert all(torch.equal(p[0], want) for p in pairs)
    # Unnamed: every rank's counter gives the same name.
    assert torch.equal(hvd.alltoall(inputs[r], splits=matrix[r])[0], want)
    assert torch.equal(inputs[r], _inputs(matrix, "float64", (2,), 8)[r]), "the input is not modified"
    return True


def test_alltoall_returns_what_horovod_returns(ranks):
    assert all(ranks.run(_return_values))


def _changing_splits():
    """One name, new splits every step (as MoE routing does): every step is right."""
    n, r = hvd.size(), hvd.rank()
    hvd.collective_stats(reset=True)
    for step in range(4):
        matrix = _matrix(n, "uneven", step)
        inputs = _inputs(matrix, "float32", (4,), 10 + step)
        out, received = hvd.alltoall(inputs[r], splits=matrix[r], name="moe.dispatch")
        assert torch.equal(out, _expected(inputs, matrix, r)), step
        assert received.tolist() == [matrix[q][r] for q in range(n)]
    # The same splits again come from the cache.
    again = hvd.alltoall(inputs[r], splits=matrix[r], name="moe.dispatch")[0]
    assert torch.equal(again, _expected(inputs, matrix, r))
    stats = [s for s in hvd.collective_stats() if s["op"] == "alltoall"]
    assert len(stats) == 1 and stats[0]["collectives"] == 5 and stats[0]["tensors"] == 5, stats
    return True


def test_alltoall_splits_may_change_from_call_to_call(ranks):
    assert all(ranks.run(_changing_splits))


def _autograd():
    n, r = hvd.size(), hvd.rank()
    matrix = _matrix(n, "uneven")
    x = make(r, (sum(matrix[r]), 3), "float64", 11).requires_grad_()
    out, received = hvd.alltoall(x, splits=matrix[r], name="a2a.grad")
    assert not received.requires_grad
    # Rank q's loss weighs its output by q + 1: a row sent to rank q gets gradient q + 1.
    (out * (r + 1)).sum().backward()
    want = torch.cat([torch.full((matrix[r][q], 3), float(q + 1), dtype=torch.float64) for q in range(n)])
    assert torch.equal(x.grad, want), (x.grad, want)
    even = make(r, (n, 2), "float64", 12).requires_grad_()
    y = hvd.alltoall(even, name="a2a.grad.even")  # without splits: the output alone, still differentiable
    (y * (r + 1)).sum().backward()
    assert torch.equal(even.grad, torch.arange(1, n + 1, dtype=torch.float64).repeat_interleave(2).reshape(n, 2))
    return True


def test_alltoall_is_differentiable(ranks):
    assert all(ranks.run(_autograd))


def _bad_calls():
    n = hvd.size()
    t = torch.ones(2 * n, 2)
    cases = {
        "sum": lambda: hvd.alltoall(t, splits=[1] * n, name="bad.sum"),
        "length": lambda: hvd.alltoall(t, splits=[2 * n], name="bad.length"),
        "negative": lambda: hvd.alltoall(t, splits=[2 * n + 1, -1] + [0] * (n - 2), name="bad.negative"),
        "uneven": lambda: hvd.alltoall(torch.ones(2 * n + 1), name="bad.uneven"),
        "scalar": lambda: hvd.alltoall(torch.tensor(1.0), name="bad.scalar"),
        "float_splits": lambda: hvd.alltoall(t, splits=torch.full((n,), 2.0), name="bad.float"),
    }
    msgs = {}
    for key, call in cases.items():
        try:
            call()
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)
    # Refusals leave nothing behind.
    assert torch.equal(hvd.alltoall(t, name="bad.after"), torch.ones(2 * n, 2))
    return msgs


def test_bad_splits_are_refused_at_the_call(ranks):
    msgs = ranks.run(_bad_calls)[0]
    expect = {"sum": "add up to dim 0", "length": "one per rank", "negative": "negative",
              "uneven": "divides dim 0 evenly", "scalar": "at least one dimension", "float_splits": "integer"}
    for key, fragment in expect.items():
        assert msgs[key] is not None, f"{key} was accepted"
        assert fragment in msgs[key], (key, msgs[key])


def _mismatch():
    r = hvd.rank()
    errors = {}
    cases = {
        "shape": lambda: hvd.alltoall(torch.ones(2 * hvd.size(), 2 + r), name="mm.shape"),
        "dtype": lambda: hvd.alltoall(torch.ones(2 * hvd.size(), dtype=torch.float32 if r == 0 else torch.int32),
                                      name="mm.dtype"),
    }
    for key, call in cases.items():
        try:
            call()
            errors[key] = None
        except hvd.HorovodInternalError as e:
            errors[key] = str(e)
    return errors


def test_ranks_that_disagree_get_an_error_naming_the_tensor(ranks):
    for errors in ranks.run(_mismatch):
        assert errors["shape"] is not None and "'mm.shape'" in errors["shape"] and "[2]" in errors["shape"] \
            and "[3]" in errors["shape"], errors["shape"]
        assert errors["dtype"] is not None and "float32" in errors["dtype"] and "int32" in errors["dtype"]
