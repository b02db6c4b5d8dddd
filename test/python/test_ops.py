"""Every op and dtype over 2 and 3 CPU ranks (Gloo), fusion on and off, against
references computed with plain torch."""

import sys
import threading
import time
import weakref

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch
from horovod_zero.torch import mpi_ops
from horovod_zero.torch.basics import _core
from horovod_zero.torch import objects
from refs import DTYPES, FLOATS, assert_close as _assert_close, dtype, make, reduce_ref, scatter_slice

OPS = ["Sum", "Average", "Min", "Max"]
# Every (dtype, op) whose reference is reduce_ref: integer Average truncates
# sum / size as Horovod does, which test_int_ops.py checks against its own reference.
REDUCTIONS = [pytest.param(d, o, id=f"{o}-{d}") for o in OPS for d in DTYPES
              if o != "Average" or dtype(d).is_floating_point]


def _allreduce(dtype_name, op_name, seed):
    n, r = hvd.size(), hvd.rank()
    shape = (4, 5)
    inputs = [make(k, shape, dtype_name, seed) for k in range(n)]
    mine = inputs[r].clone()
    out = hvd.allreduce(mine, op=getattr(hvd, op_name), name=f"ar.{dtype_name}.{op_name}.{seed}")
    assert torch.equal(mine, inputs[r]), "allreduce must not modify its input"
    _assert_close(out, reduce_ref(inputs, op_name).to(out.dtype), dtype_name)
    # In place.
    hvd.allreduce_(mine, op=getattr(hvd, op_name), name=f"ar_.{dtype_name}.{op_name}.{seed}")
    _assert_close(mine, reduce_ref(inputs, op_name).to(out.dtype), dtype_name)


@pytest.mark.parametrize("dtype_name,op_name", REDUCTIONS)
def test_allreduce(ranks_fusion, dtype_name, op_name):
    ranks_fusion.run(_allreduce, dtype_name, op_name, 1)


def _allreduce_scaled(dtype_name):
    n, r = hvd.size(), hvd.rank()
    inputs = [make(k, (7,), dtype_name, 2) for k in range(n)]
    out = hvd.allreduce(inputs[r], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"scaled.{dtype_name}")
    _assert_close(out, (3.0 * reduce_ref([0.5 * t.double() for t in inputs], "Sum")).to(out.dtype), dtype_name)
    avg = hvd.allreduce(inputs[r], op=hvd.Average, postscale_factor=2.0, name=f"scaled_avg.{dtype_name}")
    _assert_close(avg, (2.0 * reduce_ref(inputs, "Average")).to(out.dtype), dtype_name)


@pytest.mark.parametrize("dtype_name", FLOATS)
def test_allreduce_prescale_postscale(ranks, dtype_name):
    ranks.run(_allreduce_scaled, dtype_name)


def _allgather(dtype_name, out_dtype_name, uneven):
    n, r = hvd.size(), hvd.rank()
    rows = [k + 1 if uneven else 2 for k in range(n)]
    inputs = [make(k, (rows[k], 3), dtype_name, 3) for k in range(n)]
    odt = dtype(out_dtype_name) if out_dtype_name else None
    hvd.collective_stats(reset=True)
    out = hvd.allgather(inputs[r], output_dtype=odt, name=f"ag.{dtype_name}.{out_dtype_name}.{uneven}")
    ref = torch.cat(inputs)
    if odt is not None:
        ref = ref.to(odt)  # our copy-in cast must round exactly like torch
    assert out.shape == (sum(rows), 3)
    assert torch.equal(out, ref), (out, ref)
    # What crossed the wire was already of the output dtype: the cast is on the way in.
    wire = [(s["op"], s["dtype"]) for s in hvd.collective_stats()]
    assert wire == [("allgather", out_dtype_name or dtype_name)], wire


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_allgather(ranks_fusion, dtype_name, uneven):
    ranks_fusion.run(_allgather, dtype_name, None, uneven)


@pytest.mark.parametrize("out_dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_allgather_output_dtype_casts_on_the_way_in(ranks_fusion, out_dtype_name, uneven):
    ranks_fusion.run(_allgather, "float32", out_dtype_name, uneven)


def _allgather_wire_dtype():
    hvd.collective_stats(reset=True)
    hvd.allgather(torch.ones(1024), output_dtype=torch.bfloat16, name="wire")
    stats = hvd.collective_stats()
    assert [(s["op"], s["dtype"]) for s in stats] == [("allgather", "bfloat16")], stats
    return stats[0]["bytes"]


def test_allgather_output_dtype_is_the_wire_dtype(ranks):
    for b in ranks.run(_allgather_wire_dtype):
        assert b == 2 * 1024 * ranks.size  # bf16 bytes, not fp32


def _reducescatter(dtype_name, op_name, dim0):
    n, r = hvd.size(), hvd.rank()
    inputs = [make(k, (dim0, 2), dtype_name, 4) for k in range(n)]
    out = hvd.reducescatter(inputs[r], op=getattr(hvd, op_name), name=f"rs.{dtype_name}.{op_name}.{dim0}")
    _assert_close(out, scatter_slice(reduce_ref(inputs, op_name), n, r).to(out.dtype), dtype_name)


@pytest.mark.parametrize("dtype_name,op_name", REDUCTIONS)
def test_reducescatter_uneven(ranks_fusion, dtype_name, op_name):
    ranks_fusion.run(_reducescatter, dtype_name, op_name, 7)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64"])
def test_reducescatter_even(ranks_fusion, dtype_name):
    ranks_fusion.run(_reducescatter, dtype_name, "Sum", 6 * 4)


def _broadcast(dtype_name, root):
    n, r = hvd.size(), hvd.rank()
    root = root % n
    inputs = [make(k, (3, 4), dtype_name, 5) for k in range(n)]
    out = hvd.broadcast(inputs[r], root, name=f"bc.{dtype_name}.{root}")
    assert torch.equal(out, inputs[root])
    mine = inputs[r].clone()
    hvd.broadcast_(mine, root, name=f"bc_.{dtype_name}.{root}")
    assert torch.equal(mine, inputs[root])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("root", [0, -1], ids=["root0", "rootlast"])
def test_broadcast(ranks_fusion, dtype_name, root):
    ranks_fusion.run(_broadcast, dtype_name, root)


def _grouped():
    n, r = hvd.size(), hvd.rank()
    shapes = [(3,), (2, 5), (7, 2)]
    ins = [[make(k, s, "float32", 6 + i) for i, s in enumerate(shapes)] for k in range(n)]
    outs = hvd.grouped_allreduce(ins[r], op=hvd.Sum, name="g_ar")
    for i, o in enumerate(outs):
        torch.testing.assert_close(o.double(), reduce_ref([ins[k][i] for k in range(n)], "Sum"))
    gathered = hvd.grouped_allgather(ins[r], name="g_ag")
    for i, o in enumerate(gathered):
        assert torch.equal(o, torch.cat([ins[k][i] for k in range(n)]))
    scattered = hvd.grouped_reducescatter(ins[r], op=hvd.Average, name="g_rs")
    for i, o in enumerate(scattered):
        ref = scatter_slice(reduce_ref([ins[k][i] for k in range(n)], "Average"), n, r)
        torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)
    inplace = [t.clone() for t in ins[r]]
    hvd.grouped_allreduce_(inplace, op=hvd.Max, name="g_ar_")
    for i, o in enumerate(inplace):
        torch.testing.assert_close(o.double(), reduce_ref([ins[k][i] for k in range(n)], "Max"))


def test_grouped_ops(ranks_fusion):
    ranks_fusion.run(_grouped)


# Tensors of over 1 MiB that split evenly: a group of them runs as a direct group,
# whose reduce-scatter and allgather on CPU go through the rings of sends
# (csrc/transport/gloo/gloo_ring.h), each rank's segment in more than one piece.
LARGE = [(300_001,), (4, 70_000)]


def _large(dtype_name, op_name, prescale):
    n, r = hvd.size(), hvd.rank()
    shapes = [(n * s[0],) + s[1:] for s in LARGE]
    ins = [[make(k, s, dtype_name, 9 + i) for i, s in enumerate(shapes)] for k in range(n)]
    op = getattr(hvd, op_name)
    kw = dict(prescale_factor=0.5) if prescale else {}
    tag = f"{dtype_name}.{op_name}.{prescale}"
    outs = hvd.grouped_reducescatter(ins[r], op=op, name=f"big_rs.{tag}", **kw) + \
        [hvd.reducescatter(ins[r][0], op=op, name=f"big_rs1.{tag}", **kw)]  # a lone one: no group
    for i, o in zip([0, 1, 0], outs):
        ref = reduce_ref([ins[k][i] for k in range(n)], op_name)
        if prescale:
            ref = ref * 0.5
        _assert_close(o, scatter_slice(ref, n, r).to(o.dtype), dtype_name)
    # Each rank's reduced rows gathered back: the allgather rings, grouped and lone
    # (for fp32 with a cast on the way in), against every rank's outputs as they are.
    odt = torch.bfloat16 if dtype(dtype_name) == torch.float32 else None
    gathered = hvd.grouped_allgather(outs[:2], name=f"big_ag.{tag}") + \
        [hvd.allgather(outs[2], name=f"big_ag1.{tag}", output_dtype=odt)]
    every = hvd.allgather_object(outs)
    for j, g in enumerate(gathered):
        assert torch.equal(g, torch.cat([every[k][j] for k in range(n)]).to(g.dtype)), j
    # In place: the output is this rank's own slice of the input (as NCCL allows).
    x = ins[r][0].clone()
    mine = scatter_slice(x, n, r)
    hvd.synchronize(mpi_ops._enqueue(_core.OP_REDUCESCATTER, [x], [mine], [f"big_rs_inplace.{tag}"], op,
                                     prescale=0.5 if prescale else 1.0))
    _assert_close(mine, outs[2], dtype_name)


@pytest.mark.parametrize("dtype_name,op_name,prescale", [
    ("float32", "Sum", False), ("float32", "Average", False), ("float32", "Min", False), ("float32", "Max", False),
    ("float32", "Average", True), ("bfloat16", "Sum", False), ("float64", "Sum", False), ("int32", "Max", False)])
def test_large_groups_on_rings(ranks, dtype_name, op_name, prescale):
    ranks.run(_large, dtype_name, op_name, prescale)


def _async_and_poll():
    r = hvd.rank()
    hs = [hvd.allreduce_async(torch.full((3,), float(r + i)), op=hvd.Sum, name=f"async.{i}") for i in range(20)]
    outs = [hvd.synchronize(h) for h in hs]
    n = hvd.size()
    for i, o in enumerate(outs):
        assert torch.equal(o, torch.full((3,), float(sum(k + i for k in range(n)))))
    h = hvd.allgather_async(torch.ones(2), name="polled")
    while not hvd.poll(h):
        pass
    assert hvd.synchronize(h).shape == (2 * n,)
    # Grouped async ops return lists; a list of them synchronizes in the same shape.
    groups = [hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Sum, name=f"nested.{i}") for i in range(3)]
    while not hvd.poll(groups):
        pass
    outs = hvd.synchronize(groups)
    assert [[tuple(t.shape) for t in g] for g in outs] == [[(2,), (3,)]] * 3
    assert all(torch.equal(t, torch.full_like(t, float(n))) for g in outs for t in g)


def test_async_handles_and_poll(ranks):
    ranks.run(_async_and_poll)


def _tensors_dropped_on_the_caller_thread():
    # The input's last reference is the runtime's: rank 1 submits late, so the op
    # finishes after `del`. The tensor must be freed by the thread that synchronizes
    # (with the GIL), not by the runtime's background thread.
    freed_on = []
    t = torch.ones(4)
    weakref.finalize(t, lambda: freed_on.append(threading.get_ident()))
    if hvd.rank() == 1:
        time.sleep(0.3)
    h = hvd.allreduce_async(t, op=hvd.Sum, name="dropped.in")
    del t
    out = hvd.synchronize(h)
    return freed_on == [threading.get_ident()], out.tolist()


def test_tensors_are_freed_on_the_synchronizing_thread(ranks):
    for same_thread, out in ranks.run(_tensors_dropped_on_the_caller_thread):
        assert same_thread
        assert out == [float(ranks.size)] * 4


def _params_and_objects():
    r = hvd.rank()
    torch.manual_seed(100 + r)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(100)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    obj = hvd.broadcast_object({"epoch": 7, "rank": r, "blob": list(range(r * 10))}, root_rank=hvd.size() - 1)
    assert obj == {"epoch": 7, "rank": hvd.size() - 1, "blob": list(range((hvd.size() - 1) * 10))}
    hvd.barrier()


def test_broadcast_parameters_and_object(ranks):
    ranks.run(_params_and_objects)


def _in_threads(target, count):
    """Runs target(t) for t in range(count) on as many threads at once, switching
    between them as often as the interpreter can."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=(t,)) for t in range(count)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(before)


def _switch_between_lines(frame, event, arg):
    """A trace function that pauses before every line of horovod_zero/torch/objects.py
    (broadcast_object and its naming), letting the other thread run: threads in it then
    interleave at every point, as free-threaded Python lets them, not only where
    CPython 3.11 happens to switch (never between reading and writing the old count)."""
    if frame.f_code.co_filename != objects.broadcast_object.__code__.co_filename:
        return None
    if event == "line":
        time.sleep(0.0005)  # long enough for the other thread to run, however loaded the machine
    return _switch_between_lines


def _objects_from_two_threads(calls):
    """Two threads per rank broadcast objects from rank 0 at the same time, unnamed,
    then named by thread. Returns each thread's results, and the errors."""
    hvd.init()
    got, errors = {"unnamed": [[], []], "named": [[], []]}, []
    start = threading.Barrier(2)

    def thread(t):
        try:
            start.wait()
            sys.settrace(_switch_between_lines)  # this thread only
            try:
                for i in range(calls):
                    got["unnamed"][t].append(hvd.broadcast_object((t, i), root_rank=0))
            finally:
                sys.settrace(None)
            for i in range(calls):
                got["named"][t].append(hvd.broadcast_object((t, i), root_rank=0, name=f"threads.{t}.{i}"))
        except BaseException as e:
            errors.append(f"thread {t}: {e!r}")

    _in_threads(thread, 2)
    hvd.shutdown()
    return got, errors


def test_broadcast_object_from_two_threads_at_once():
    """Unnamed calls from several threads take distinct, consecutive names on every
    rank, so each object arrives exactly once and nothing stalls (a name taken twice
    is refused as already in flight, or leaves the ranks waiting for names the others
    never send: the stall limit turns that into an error here). The threads switch
    between every two lines of objects.py, which made the old unlocked count fail
    this in 5 runs of 5 (and the new one without its lock in 3 of 3). Each thread's
    calls may pair with the other thread's on another rank; named calls pair by name."""
    calls = 50
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}
    res = launch(_objects_from_two_threads, 2, calls, env=env, timeout=120)
    assert sorted(res) == [0, 1], res
    sent = [[(t, i) for i in range(calls)] for t in range(2)]
    for rank, (status, value) in res.items():
        assert status == "ok", value
        got, errors = value
        assert errors == [], (rank, errors)
        assert sorted(got["unnamed"][0] + got["unnamed"][1]) == sorted(sent[0] + sent[1]), rank
        assert got["named"] == sent, rank
    assert res[0][1][0]["unnamed"] == sent  # the root gets back what it sent


def _object_names_per_job(threads, takes):
    from horovod_zero.torch.basics import _runtime
    _object_names = objects._object_names
    hvd.init()
    names = [[] for _ in range(threads)]

    def take(t):
        for _ in range(takes):
            names[t].append(_object_names.take(_runtime()))

    _in_threads(take, threads)
    unnamed = hvd.broadcast_object("next", root_rank=0)  # takes the next number
    next_name = _object_names.take(_runtime())
    hvd.shutdown()
    hvd.init()
    after_reinit = _object_names.take(_runtime())
    hvd.shutdown()
    return [n for per_thread in names for n in per_thread], unnamed, next_name, after_reinit


def test_unnamed_broadcast_object_names_are_unique_consecutive_and_per_init():
    """The names unnamed broadcast_object() calls take, drawn by many threads at once:
    each number once, none skipped; a new init() starts again at 0. (Drawing them
    without the lock fails this: the read and the write of the count are separate
    Python calls, and the threads switch between them.)"""
    threads, takes = 8, 5000
    res = launch(_object_names_per_job, 1, threads, takes, timeout=120)
    status, value = res[0]
    assert status == "ok", value
    names, unnamed, next_name, after_reinit = value
    total = threads * takes
    assert sorted(names, key=lambda n: int(n.rsplit(".", 1)[1])) == [f"broadcast_object.{k}" for k in range(total)]
    assert unnamed == "next"
    assert next_name == f"broadcast_object.{total + 1}"
    assert after_reinit == "broadcast_object.0"


def _world_info():
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
            str(hvd.device()), hvd.is_initialized())


def test_world_info(ranks):
    infos = ranks.run(_world_info)
    n = ranks.size
    assert infos == [(k, n, k, n, 0, 1, "cpu", True) for k in range(n)]
