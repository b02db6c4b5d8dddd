"""hvd.join() over 2 and 3 CPU ranks: ranks that run different numbers of steps,
checked against sums worked out by hand; what a joined rank allows and refuses;
and a rank that leaves without join(), which the others must hear about by name."""

import time

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch


def _steps(rank, size, epoch=0):
    """Rank r runs 2 + r steps in epoch 0 (the last rank runs most), and
    size - r steps in epoch 1 (rank 0 runs most)."""
    return 2 + rank if epoch == 0 else size - rank


def _want(step, size, epoch, op, scale=1.0):
    """Every rank contributes (q + 1) * (step + 1) while it still has steps; joined ranks add zeros."""
    total = sum((q + 1) * (step + 1) * scale for q in range(size) if _steps(q, size, epoch) > step)
    return total / size if op == "Average" else total


def _uneven(kind, op_name, epochs):
    n, r = hvd.size(), hvd.rank()
    op = getattr(hvd, op_name)
    lasts = []
    for epoch in range(epochs):
        for i in range(_steps(r, n, epoch)):
            value = float((r + 1) * (i + 1))
            # "cached": one name every step (the cache serves it); "fresh": a new name each step.
            name = f"join.{kind}.{op_name}" if kind == "cached" else f"join.{kind}.{op_name}.{epoch}.{i}"
            if kind == "grouped":
                outs = hvd.grouped_allreduce([torch.full((3,), value), torch.full((2, 2), 2 * value)], op=op, name=name)
                assert torch.allclose(outs[0], torch.full((3,), _want(i, n, epoch, op_name))), (epoch, i, outs)
                assert torch.allclose(outs[1], torch.full((2, 2), _want(i, n, epoch, op_name, 2.0))), (epoch, i, outs)
            else:
                out = hvd.allreduce(torch.full((3,), value), op=op, name=name)
                assert torch.allclose(out, torch.full((3,), _want(i, n, epoch, op_name))), (epoch, i, out)
        lasts.append(hvd.join())
    return lasts


@pytest.mark.parametrize("kind", ["fresh", "cached", "grouped"])
@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_joined_ranks_add_zeros_to_the_others_allreduces(ranks, kind, op_name):
    lasts = ranks.run(_uneven, kind, op_name, 2)
    # Epoch 0: the last rank runs most steps, so it joins last; epoch 1: rank 0.
    assert lasts == [[ranks.size - 1, 0]] * ranks.size, lasts


def _integer_average():
    n, r = hvd.size(), hvd.rank()
    outs = []
    for i in range(1 + r):
        outs.append(hvd.allreduce(torch.tensor([7 * (r + 1), -7 * (r + 1)]), op=hvd.Average, name="join.int").tolist())
    hvd.join()
    return outs


def test_integer_average_with_joined_ranks_truncates_like_horovod(ranks):
    n = ranks.size
    for r, outs in enumerate(ranks.run(_integer_average)):
        for i, got in enumerate(outs):
            s = sum(7 * (q + 1) for q in range(n) if q + 1 > i)
            want = int(s / n)  # the sum divided by every rank, truncated toward zero
            assert got == [want, -want], (r, i, got)


def _others_while_joined():
    n, r = hvd.size(), hvd.rank()
    if r == 0:
        return hvd.join(), {}
    errors = {}
    cases = {
        "allgather": lambda: hvd.allgather(torch.ones(2), name="jo.gather"),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=1, name="jo.bcast"),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(2 * n), name="jo.scatter"),
        "alltoall": lambda: hvd.alltoall(torch.ones(2 * n), name="jo.a2a"),
    }
    for key, call in cases.items():
        t0 = time.monotonic()
        try:
            call()
            errors[key] = None
        except hvd.HorovodInternalError as e:
            errors[key] = (str(e), time.monotonic() - t0)
    # Allreduce still works without rank 0, Min and Max see its zeros as in Horovod.
    errors["sum"] = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum, name="jo.sum").tolist()
    errors["max"] = hvd.allreduce(torch.full((2,), -1.0 - r), op=hvd.Max, name="jo.max").tolist()
    errors["product"] = hvd.allreduce(torch.full((2,), 3.0), op=hvd.Product, name="jo.prod").tolist()
    return hvd.join(), errors


def test_only_allreduce_runs_without_a_joined_rank(ranks):
    n = ranks.size
    out = ranks.run(_others_while_joined)
    lasts = {last for last, _ in out}
    assert len(lasts) == 1 and lasts.pop() in range(1, n), out
    for r, (_, errors) in enumerate(out[1:], start=1):
        for key, name in [("allgather", "jo.gather"), ("broadcast", "jo.bcast"), ("reducescatter", "jo.scatter"),
                          ("alltoall", "jo.a2a")]:
            assert errors[key] is not None, f"{key} ran without rank 0"
            msg, seconds = errors[key]
            assert f"'{name}'" in msg and "ranks [0]" in msg and "hvd.join()" in msg, msg
            assert seconds < 5
        assert errors["sum"] == [float(sum(range(1, n)))] * 2
        assert errors["max"] == [0.0, 0.0], "rank 0's zeros are the maximum of negative values"
        assert errors["product"] == [0.0, 0.0]


def _join_alone():
    return hvd.join()


def test_join_with_nothing_to_do_returns_the_same_rank_everywhere(ranks):
    lasts = ranks.run(_join_alone)
    assert len(set(lasts)) == 1 and 0 <= lasts[0] < ranks.size


# --- a rank that leaves without join() -------------------------------------------

def _leaver(steps_of, how):
    hvd.init()
    r = hvd.rank()
    for i in range(steps_of[r]):
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"leave.step.{i}")
    if r == 1:
        time.sleep(1.0)  # the others' next step is waiting on this rank by now
        if how == "shutdown":
            hvd.shutdown()
        return "left"  # the process exits: atexit shuts horovod_zero down
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"leave.step.{steps_of[r]}")
        return None
    except hvd.HorovodInternalError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("size,how", [(2, "exit"), (3, "shutdown")])
def test_a_rank_that_leaves_early_is_named_with_the_waiting_tensor(size, how):
    steps = [2] * size
    out = launch(_leaver, size, steps, how, timeout=120)
    assert out.get(1) == ("ok", "left"), out.get(1)
    for r in range(size):
        if r == 1:
            continue
        status, value = out[r]
        assert status == "ok" and value is not None, (r, out[r])
        msg, seconds = value
        assert "'leave.step.2'" in msg and "rank 1 shut down" in msg and "hvd.join()" in msg, msg
        assert seconds < 10, seconds
