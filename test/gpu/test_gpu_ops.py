"""The CUDA path over NCCL: every op against plain-torch references, the fused
cast kernel, fusion counts, stream ordering, and CPU and CUDA ops in one cycle.

Every test runs as a job of 1 rank on one GPU (the runtime, the copy and cast
kernels and the streams, with NCCL on one rank) and of 2 ranks on two; those that
need a late peer run on two only. test/gpu/conftest.py selects by the GPUs present."""

import time

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch, on_gpus, shared_pool
from refs import assert_close, make, reduce_ref, scatter_slice

pytestmark = pytest.mark.gpu

# Direct NCCL groups off: large fused ops go through the fusion buffer (and its copy
# streams), as they do by default on more than 4 ranks.
BUFFER_ENV = {"HOROVOD_ZERO_DIRECT_MAX_TENSORS": "0"}


@pytest.fixture(params=on_gpus(1, 2))
def gpus(request):
    return shared_pool(request.param)


@pytest.fixture(params=on_gpus(1, 2))
def gpus_buffer(request):
    return shared_pool(request.param, env=BUFFER_ENV)


def _close(out, ref, dtype_name):
    assert out.is_cuda
    assert_close(out, ref, dtype_name)


def _ops(dtype_name):
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    assert dev.type == "cuda" and hvd.cuda_built()
    ins = [make(k, (33, 5), dtype_name, 7) for k in range(n)]
    mine = ins[r].to(dev)
    float_dt = mine.dtype.is_floating_point
    for op_name in ("Sum", "Min", "Max") + (("Average",) if float_dt else ()):
        out = hvd.allreduce(mine, op=getattr(hvd, op_name), name=f"g.ar.{dtype_name}.{op_name}")
        _close(out, reduce_ref(ins, op_name).to(out.dtype), dtype_name)
        rs = hvd.reducescatter(mine, op=getattr(hvd, op_name), name=f"g.rs.{dtype_name}.{op_name}")
        _close(rs, scatter_slice(reduce_ref(ins, op_name), n, r).to(rs.dtype), dtype_name)
    uneven = make(r, (r + 2, 3), dtype_name, 8).to(dev)
    ag = hvd.allgather(uneven, name=f"g.ag.{dtype_name}")
    assert torch.equal(ag.cpu(), torch.cat([make(k, (k + 2, 3), dtype_name, 8) for k in range(n)]))
    bc = hvd.broadcast(mine, root_rank=n - 1, name=f"g.bc.{dtype_name}")
    assert torch.equal(bc.cpu(), ins[n - 1])
    if float_dt:
        scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name=f"g.sc.{dtype_name}")
        _close(scaled, 2.0 * reduce_ref(ins, "Sum").to(scaled.dtype).double(), dtype_name)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8"])
def test_cuda_ops_match_torch(gpus, dtype_name):
    gpus.run(_ops, dtype_name)


def _cast_on_the_way_in(out_dtype_name):
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    odt = getattr(torch, out_dtype_name)
    specials = torch.tensor([65504.0, 65520.0, 1e-8, 6e-8, 1.00390625, 3.4e38, -0.0], dtype=torch.float32)
    ins = [torch.cat([specials, make(k, (4096,), "float32", 9) * 1e3]) for k in range(n)]
    hvd.collective_stats(reset=True)
    out = hvd.allgather(ins[r].to(dev), output_dtype=odt, name=f"g.cast.{out_dtype_name}")
    ref = torch.cat(ins).to(odt)
    assert out.dtype == odt
    assert torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16)), "CUDA cast must round like torch"
    (stat,) = [s for s in hvd.collective_stats() if s["device"] == "cuda"]
    assert stat["dtype"] == out_dtype_name and stat["bytes"] == 2 * ref.numel()


@pytest.mark.parametrize("out_dtype_name", ["bfloat16", "float16"])
def test_cuda_cast_kernel_rounds_like_torch_and_halves_the_wire(gpus, out_dtype_name):
    gpus.run(_cast_on_the_way_in, out_dtype_name)


def _fused_cuda():
    dev = hvd.device()
    hvd.collective_stats(reset=True)
    ts = [torch.full((i + 1,), float(i), device=dev) for i in range(300)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="g.fused")
    for i, o in enumerate(outs):
        assert torch.equal(o.cpu(), torch.full((i + 1,), float(i * hvd.size())))
    gathered = hvd.grouped_allgather([torch.full((2, i + 1), float(hvd.rank()), device=dev) for i in range(100)],
                                     name="g.fused_ag")
    for i, o in enumerate(gathered):
        assert torch.equal(o.cpu(), torch.cat([torch.full((2, i + 1), float(k)) for k in range(hvd.size())]))
    return {(s["op"], s["device"]): s["collectives"] for s in hvd.collective_stats()}


def test_cuda_fusion_makes_one_collective_per_group(gpus):
    for stats in gpus.run(_fused_cuda):
        assert stats == {("allreduce", "cuda"): 1, ("allgather", "cuda"): 1}, stats


def _made_slowly_on_this_stream():
    """64 MiB of rank + 1, from long producer work on the current (the user's) stream."""
    x = torch.ones(1 << 24, device=hvd.device())
    for _ in range(20):
        x = x * 1.0 + 0.0
    return x.add_(hvd.rank())


def _stream_order():
    with torch.cuda.stream(torch.cuda.Stream()):
        x = _made_slowly_on_this_stream()
        out = hvd.allreduce(x, op=hvd.Sum, name="g.stream")
    return out[:4].cpu().tolist(), out[-1].item()


def test_collective_waits_for_the_producer_stream(gpus):
    n = gpus.size
    expect = float(sum(1 + k for k in range(n)))
    for head, tail in gpus.run(_stream_order):
        assert head == [expect] * 4 and tail == expect


def _mixed_cycle():
    dev = hvd.device()
    hvd.collective_stats(reset=True)
    hs = []
    for i in range(10):
        hs.append(hvd.allreduce_async(torch.full((3,), float(i)), op=hvd.Sum, name=f"g.mix.cpu.{i}"))
        hs.append(hvd.allreduce_async(torch.full((3,), float(i), device=dev), op=hvd.Sum, name=f"g.mix.cuda.{i}"))
    outs = hvd.synchronize(hs)
    for i in range(10):
        assert torch.equal(outs[2 * i], torch.full((3,), float(i * hvd.size())))
        assert outs[2 * i + 1].is_cuda and torch.equal(outs[2 * i + 1].cpu(), torch.full((3,), float(i * hvd.size())))
    return sorted({s["device"] for s in hvd.collective_stats()})


def test_cpu_and_cuda_ops_in_flight_together(gpus):
    assert gpus.run(_mixed_cycle) == [["cpu", "cuda"]] * gpus.size


def _buffer_path_casts_and_scales(pad=0):
    """Grouped ops on 40 tensors; returns the CUDA collectives as (op, calls, tensors).
    `pad`: elements added to each rank's part of every tensor."""
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    g = torch.Generator().manual_seed(11)
    sizes = [int(x) for x in torch.randint(1, 300_000, (40,), generator=g)]  # odd sizes: vector bodies and tails
    sizes = [(s + pad) * n for s in sizes]
    hvd.collective_stats(reset=True)
    ins = [[make(k, (s,), "float32", 12 + i) for i, s in enumerate(sizes)] for k in range(n)]
    gathered = hvd.grouped_allgather([t.to(dev) for t in ins[r]], output_dtype=torch.bfloat16, name="g.buf.ag")
    for i, o in enumerate(gathered):
        assert torch.equal(o.cpu(), torch.cat([ins[k][i] for k in range(n)]).to(torch.bfloat16))
    scattered = hvd.grouped_reducescatter([t.to(dev) for t in ins[r]], op=hvd.Average, prescale_factor=0.5,
                                          name="g.buf.rs")
    for i, o in enumerate(scattered):
        ref = scatter_slice(0.5 * reduce_ref([ins[k][i] for k in range(n)], "Average"), n, r)
        torch.testing.assert_close(o.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    reduced = hvd.grouped_allreduce([t.to(dev) for t in ins[r]], op=hvd.Sum, postscale_factor=0.25, name="g.buf.ar")
    for i, o in enumerate(reduced):
        torch.testing.assert_close(o.cpu().double(), 0.25 * reduce_ref([ins[k][i] for k in range(n)], "Sum"),
                                   rtol=1e-5, atol=1e-5)
    return sorted((s["op"], s["collectives"], s["tensors"]) for s in hvd.collective_stats() if s["device"] == "cuda")


def test_fusion_buffer_path_with_casts_scales_and_odd_sizes(gpus_buffer):
    gpus_buffer.run(_buffer_path_casts_and_scales)


def test_forty_tensors_in_one_direct_group_with_casts_and_scales(gpus):
    # The same ops by default on 2 ranks: 40 tensors of ~1 MiB each, one NCCL group.
    # On 1 rank the same tensors average under 1 MiB, where groups take the fusion
    # buffer instead (executor_direct.cc): pad them over it there.
    pad = 1 << 17 if gpus.size == 1 else 0
    for stats in gpus.run(_buffer_path_casts_and_scales, pad):
        assert stats == [("allgather", 1, 40), ("allreduce", 1, 40), ("reducescatter", 1, 40)], stats


def _direct_groups(mixed):
    """Large tensors: one NCCL call each, in one group. `mixed`: small tensors between
    them, which share one fusion buffer and one call inside the same group."""
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    if mixed:
        big = [(1 << 20) * n + 16 * n * i for i in range(4)]  # over 4 MiB each: a call each
        small = [n * (37 * i + 5) for i in range(8)]          # odd sizes, well under 4 MiB
        sizes = [big[0], small[0], small[1], big[1], small[2], small[3], big[2], small[4], small[5], big[3],
                 small[6], small[7]]
    else:
        sizes = [(1 << 20) * n + 8 * n * i for i in range(5)]
    ins = [[make(k, (s,), "float32", 20 + i) for i, s in enumerate(sizes)] for k in range(n)]
    mine = [t.to(dev) for t in ins[r]]
    hvd.collective_stats(reset=True)
    for odt in (None, torch.bfloat16):
        out = hvd.grouped_allgather(mine, output_dtype=odt, name=f"g.direct.ag.{odt}")
        for i, o in enumerate(out):
            ref = torch.cat([ins[k][i] for k in range(n)])
            assert torch.equal(o.cpu(), ref if odt is None else ref.to(odt))
    for pre in (1.0, 0.5):  # 0.5: scaled copies in one scratch buffer, every tensor a call
        out = hvd.grouped_reducescatter(mine, op=hvd.Average, prescale_factor=pre, name=f"g.direct.rs.{pre}")
        for i, o in enumerate(out):
            ref = scatter_slice(pre * reduce_ref([ins[k][i] for k in range(n)], "Average"), n, r)
            torch.testing.assert_close(o.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    copies = [t.clone() for t in mine]
    hvd.grouped_allreduce_(copies, op=hvd.Sum, postscale_factor=0.5, name="g.direct.ar")
    for i, o in enumerate(copies):
        torch.testing.assert_close(o.cpu().double(), 0.5 * reduce_ref([ins[k][i] for k in range(n)], "Sum"),
                                   rtol=1e-5, atol=1e-5)
    # The API has no grouped broadcast; the internal enqueue makes one group of them.
    from horovod_zero.torch import mpi_ops
    targets = [t.clone() if r == 0 else torch.zeros_like(t) for t in mine]
    hvd.synchronize(mpi_ops._enqueue(mpi_ops._core.OP_BROADCAST, targets, targets,
                                     [f"g.direct.bc.{i}" for i in range(len(targets))], root=0))
    for i, t in enumerate(targets):
        assert torch.equal(t.cpu(), ins[0][i])
    # Every group above was one grouped launch, not one collective per tensor.
    return sorted((s["op"], s["collectives"], s["tensors"]) for s in hvd.collective_stats() if s["device"] == "cuda")


@pytest.mark.parametrize("mixed", [False, True], ids=["large", "large+small"])
def test_direct_nccl_groups(gpus, mixed):
    for stats in gpus.run(_direct_groups, mixed):
        m = 12 if mixed else 5
        assert stats == [("allgather", 1, m), ("allgather", 1, m), ("allreduce", 1, m), ("broadcast", 1, m),
                         ("reducescatter", 2, 2 * m)], stats


def _large_lone_tensors():
    """Lone tensors larger than the fusion threshold: a broadcast and an out-of-place
    allreduce run in their outputs, and an uneven allgather's buffer is its own op's
    (stream-ordered), so no buffer of their size stays allocated for the job."""
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    big = 80 << 20  # elements: 320 MiB of fp32, above twice the 128 MiB default threshold
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)  # this rank's GPU, which need not be the current one
    t = torch.full((big,), float(r + 1), device=dev)
    hvd.broadcast_(t, root_rank=n - 1, name="big.bcast")
    out = hvd.allreduce(t, op=hvd.Sum, name="big.ar")
    rows = (r + 1) * (40 << 20)
    g = hvd.allgather(torch.full((rows,), float(r), device=dev), name="big.ag")
    torch.cuda.synchronize(dev)
    live = sum(x.numel() * x.element_size() for x in (t, out, g))
    extra = torch.cuda.memory_allocated(dev) - base - live
    ok = (bool((t == n).all()) and bool((out == n * n).all())
          and all(bool((g[sum((k + 1) * (40 << 20) for k in range(k0)):][:(k0 + 1) * (40 << 20)] == k0).all())
                  for k0 in range(n)))
    return ok, extra


def test_large_lone_tensors_hold_no_buffer_of_their_size(gpus):
    for ok, extra in gpus.run(_large_lone_tensors):
        assert ok
        assert extra < 64 << 20, f"{extra / 2**20:.0f} MiB held beyond the tensors"


def _fused_buffer_is_not_held():
    """A fused op's CUDA buffer is the op's own, from torch's caching allocator: once
    the op is done, only its inputs and outputs are allocated."""
    dev = hvd.device()
    ins = [torch.randn(1 << 18, device=dev) for _ in range(64)]  # direct groups off: the fusion buffer path
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)  # this rank's GPU, which need not be the current one
    outs = hvd.grouped_allgather(ins, name="held.ag")
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) - base - sum(o.numel() * o.element_size() for o in outs)


def test_fused_ops_hold_no_buffer_once_done(gpus_buffer):
    for extra in gpus_buffer.run(_fused_buffer_is_not_held):
        assert extra < 1 << 20, f"{extra / 2**20:.1f} MiB still allocated after the op"


def _let_go_once_queued():
    """A reduce-scatter whose handle lets go of its tensors once queued (GradReducer does
    it for every gradient): the caller's input counts as freed as soon as the caller
    drops it, before the op has run, and the op still reads it and writes its output."""
    from horovod_zero.torch import enqueue as ops
    from horovod_zero.torch.basics import _core
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    x = torch.full((n << 22,), float(r + 1), device=dev)  # 16 MiB per rank's slice
    out = torch.empty(1 << 22, device=dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    (h,) = ops._enqueue(_core.OP_REDUCESCATTER, [x], [out], ["letgo.rs"], ops.Sum)
    side, deadline = torch.cuda.Stream(dev), time.monotonic() + 30
    while not ops._try_let_go([h], dev, side)[0]:
        assert time.monotonic() < deadline, "the reduce-scatter was never queued"
        time.sleep(0.001)
    del x
    freed = base - torch.cuda.memory_allocated(dev)
    torch.cuda.current_stream(dev).wait_stream(side)  # the reader of `out` orders itself after the op
    held = ops.synchronize(h)  # let go: the handle hands back nothing
    released_settled = ops._try_let_go([h], dev, side) == [True]  # ZeRO's list may still hold it
    return freed, (n << 22) * 4, held is None and released_settled, bool((out == n * (n + 1) / 2).all())


def test_a_handle_lets_go_of_its_tensors_once_queued(gpus):
    for freed, input_bytes, nothing_held, right in gpus.run(_let_go_once_queued):
        assert freed == input_bytes, (freed, input_bytes)  # before the op ran, or not
        assert nothing_held and right


def _fusion_buffer_path_on_one_stream():
    hvd.init()
    _buffer_path_casts_and_scales()
    hvd.shutdown()


@pytest.mark.parametrize("size", on_gpus(1, 2))
def test_fusion_buffer_path_with_the_copy_streams_off(size):
    # The default sends these buffers (tens of MiB) through the copy streams; this is
    # the same test with every copy on the NCCL stream.
    out = launch(_fusion_buffer_path_on_one_stream, size, env={"HOROVOD_ZERO_COPY_STREAM_BYTES": "0", **BUFFER_ENV})
    assert out == {r: ("ok", None) for r in range(size)}, out


def _back_to_back_on_one_tensor():
    """Three in-place sums in flight together on the same tensors. Each reads what the
    one before it (in whichever order the runtime runs them) may still be writing from
    its copy-out stream, so it must wait for that: any order gives 6 * n**3, a read of
    half-written tensors does not."""
    n, dev = hvd.size(), hvd.device()
    ts = [torch.ones(1 << 20, device=dev) for _ in range(24)]
    # Different prescale factors keep the three from being fused together (one fused
    # group with the same tensor twice would read it once for both); the products commute.
    hs = [hvd.grouped_allreduce_async_(ts, op=hvd.Sum, prescale_factor=f, name=f"b2b.{f}") for f in (1.0, 2.0, 3.0)]
    hvd.synchronize(hs)
    return sum(int((t != 6 * n ** 3).sum()) for t in ts)


def test_ops_on_the_same_tensor_wait_for_earlier_copies_out(gpus_buffer):
    assert gpus_buffer.run(_back_to_back_on_one_tensor) == [0] * gpus_buffer.size


def _stream_order_fused():
    n = hvd.size()
    with torch.cuda.stream(torch.cuda.Stream()):
        x = _made_slowly_on_this_stream()
        parts = list(x.view(32, -1))  # 32 tensors, 64 MiB: the fusion buffer and its copy streams
        outs = hvd.grouped_allgather(parts, name="g.stream.fused")
    expect = torch.cat([torch.full((1 << 19,), 1.0 + k) for k in range(n)])
    return all(torch.equal(o.cpu(), expect) for o in outs)


def test_fused_copy_in_waits_for_the_producer_stream(gpus_buffer):
    assert gpus_buffer.run(_stream_order_fused) == [True] * gpus_buffer.size



def _outputs_never_take_memory_the_caller_still_reads(parts):
    """Outputs are allocated on the background thread, after the caller's ready event.
    Two ways one could land on memory that kernels queued on the caller's stream after
    that event still read: (a) a tensor the caller freed after enqueueing the op, (b) an
    earlier op's output, read and freed likewise. A sleep kernel holds rank 0's stream so
    that those reads run late, and rank 1 enqueues late so that rank 0 allocates only
    after the free; a collective writing into such memory changes what the reads see."""
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    rows = (3 << 20) // parts  # 12 MiB of float32 per rank: the copy streams' size with parts > 1

    def shards(tag):
        return [torch.full((rows,), float(100 * tag + r * parts + i), device=dev) for i in range(parts)]

    def gather(tag, inputs):
        if r != 0:
            time.sleep(0.2)
        return hvd.grouped_allgather_async(inputs, name=f"g.reuse.{parts}.{tag}")

    def expect(tag):
        return [torch.cat([torch.full((rows,), float(100 * tag + k * parts + i)) for k in range(n)])
                for i in range(parts)]

    def hold_stream():
        if r == 0:
            torch.cuda._sleep(int(1.5e9))  # ~0.75 s at H100/H200 clocks

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    hvd.barrier()
    x = torch.full((rows * n,), -1.0, device=dev)  # exactly one output's size
    h = gather(1, shards(1))
    hold_stream()
    y = x.clone()  # queued behind the sleep
    del x
    outs = hvd.synchronize(h)
    freed_input_kept = bool((y == -1).all())
    first_ok = all(torch.equal(o.cpu(), e) for o, e in zip(outs, expect(1)))
    hvd.barrier()
    h = gather(2, shards(2))
    hold_stream()
    copies = [o.clone() for o in outs]  # queued behind the sleep
    del outs
    outs = hvd.synchronize(h)
    freed_output_kept = all(torch.equal(c.cpu(), e) for c, e in zip(copies, expect(1)))
    second_ok = all(torch.equal(o.cpu(), e) for o, e in zip(outs, expect(2)))
    return freed_input_kept, freed_output_kept, first_ok, second_ok


# These need a second rank: its late submission is what makes rank 0 allocate the
# outputs only after the caller's free.
@pytest.mark.gpus(2)
def test_outputs_never_take_memory_the_caller_still_reads():
    pool = shared_pool(2)
    assert pool.run(_outputs_never_take_memory_the_caller_still_reads, 1) == [(True,) * 4] * pool.size


@pytest.mark.gpus(2)
def test_fused_outputs_never_take_memory_the_caller_still_reads():
    pool = shared_pool(2, env=BUFFER_ENV)
    assert pool.run(_outputs_never_take_memory_the_caller_still_reads, 4) == [(True,) * 4] * pool.size


def _stream_ordered_wait(as_list=False):
    """A stream-ordered wait returns once the gather is queued on the GPU; the current
    stream's next kernels still see its result. The NCCL stream is kept busy with a large
    allreduce first, so a read that was not ordered after the gather would find the
    sentinel the output was filled with. as_list: a grouped gather of two tensors (one fused
    collective, one event) waited for by one call with both handles."""
    from horovod_zero.torch import mpi_ops
    from horovod_zero.torch.basics import _core
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    seen = []
    for k in range(5):
        busy = torch.ones(64 << 20, device=dev)  # 256 MiB ahead of the gather on the NCCL stream
        hb = hvd.allreduce_async(busy, op=hvd.Sum, name=f"so.busy.{k}")
        shard = torch.full((1 << 20,), float(r + 1 + k), device=dev)
        out = torch.full((n << 20,), -1.0, device=dev)
        if as_list:
            other = torch.full((n << 20,), -1.0, device=dev)
            hs = mpi_ops._enqueue(_core.OP_ALLGATHER, [shard, shard.clone()], [other, out], [f"so.o.{k}", f"so.g.{k}"])
            mpi_ops._wait_stream(hs, dev)
            first = out.view(n, -1)[:, :8].clone()  # queued right away on the current stream
            assert torch.equal(other.view(n, -1)[:, :8], first)
            mpi_ops.synchronize(hs)
        else:
            (h,) = mpi_ops._enqueue(_core.OP_ALLGATHER, [shard], [out], [f"so.g.{k}"])
            mpi_ops._wait_stream(h, dev)
            first = out.view(n, -1)[:, :8].clone()  # queued right away on the current stream
            mpi_ops.synchronize(h)
        hvd.synchronize(hb)
        seen.append(first.cpu())
    return all(torch.equal(s, torch.arange(1, n + 1, dtype=torch.float32).add(k)[:, None].expand(n, 8))
               for k, s in enumerate(seen))


@pytest.mark.parametrize("as_list", [False, True], ids=["one", "list"])
def test_stream_ordered_wait_orders_the_callers_stream_after_the_op(gpus, as_list):
    assert gpus.run(_stream_ordered_wait, as_list) == [True] * gpus.size


def _processes_on_gpu0():
    import os
    import subprocess
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    hvd.synchronize(hvd.allreduce_async(torch.ones(4, device="cuda"), name="ctx.probe"))
    hvd.allreduce(torch.zeros(1), name="ctx.done")  # every rank's runtime has made its device state
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    pids = {int(x) for x in out.split()}
    hvd.allreduce(torch.zeros(1), name="ctx.listed")
    hvd.shutdown()
    return os.getpid(), pids


@pytest.mark.gpus(2)
def test_no_rank_but_the_first_makes_a_context_on_gpu_0():
    # On CUDA 12+, cudaSetDevice(0) makes a context: a runtime thread that set device 0 back
    # after its work on device 1 cost every other rank about 500 MiB of GPU 0.
    res = launch(_processes_on_gpu0, 2, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    (pid0, seen), (pid1, _) = res[0][1], res[1][1]
    assert pid0 in seen, (pid0, seen)  # nvidia-smi shows this container's processes
    assert pid1 not in seen, (pid1, seen)
