"""CUDA allgathers on a lane of their own (HOROVOD_ZERO_GATHER_STREAM=1, [Note: the
gather lane] in csrc/ops/cuda_context.h) on 1 and 2 GPUs, against plain-torch
references: gathers, reduce-scatters and allreduces in flight together all match; a
gather of a tensor that an allreduce on the other lane is still writing waits for it;
ZeRO stages 2 and 3 train to the CPU reference; on 2 GPUs the gathers' kernels run on
another stream than the reductions'."""

import time

import pytest
import torch

import horovod_zero.torch as hvd
from gpu_trace import profiled_events
from harness import on_gpus, shared_pool
from refs import make
from test_gpu_stage3 import check_stage3_trains_to_the_reference
from test_gpu_zero import _zero_on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).multi_processor_count < 128,
    reason="the gather lane needs a GPU of 128 SMs or more")]

# A small fusion threshold makes many ops; side copy streams for every fused op, so that
# both lanes' copy streams are in use.
LANE_ENV = {"HOROVOD_ZERO_GATHER_STREAM": "1", "HOROVOD_FUSION_THRESHOLD": str(1 << 20),
            "HOROVOD_ZERO_COPY_STREAM_BYTES": "1"}


@pytest.fixture(params=on_gpus(1, 2))
def gpus_lane(request):
    return shared_pool(request.param, env=LANE_ENV)


def _mixed():
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    handles = []
    for i in range(30):
        g = make(r, (4096 + 31 * i, 3), "float32", 100 + i).to(dev)
        handles.append(("ag", i, hvd.allgather_async(g, name=f"lane.ag.{i}")))
        rs = make(r, (n * (512 + i), 2), "float32", 200 + i).to(dev)
        handles.append(("rs", i, hvd.reducescatter_async(rs, op=hvd.Sum, name=f"lane.rs.{i}")))
        ar = make(r, (1000 + i,), "float32", 300 + i).to(dev)
        handles.append(("ar", i, hvd.allreduce_async(ar, op=hvd.Sum, name=f"lane.ar.{i}")))
    ok = []
    for kind, i, h in handles:
        got = hvd.synchronize(h).cpu()
        if kind == "ag":
            want = torch.cat([make(k, (4096 + 31 * i, 3), "float32", 100 + i) for k in range(n)])
        elif kind == "rs":
            full = sum(make(k, (n * (512 + i), 2), "float32", 200 + i) for k in range(n))
            want = full.chunk(n)[r]
        else:
            want = sum(make(k, (1000 + i,), "float32", 300 + i) for k in range(n))
        ok.append(torch.allclose(got, want, rtol=1e-6, atol=1e-6))
    return all(ok), hvd.runtime_info()["gather_lanes"]


def test_collectives_in_flight_on_both_lanes_match_torch(gpus_lane):
    for ok, lanes in gpus_lane.run(_mixed):
        assert ok
        assert lanes >= 1  # a context with the gather lane open


def _gather_after_allreduce_on_the_other_lane():
    """An allreduce in place whose input is ready only after a second of GPU sleep, then a
    gather of the same tensor whose input is ready at once, on another stream: one stream
    ordered them, two lanes must too (the copy streams' pending tensors)."""
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    x = make(r, (1 << 16,), "float32", 7).to(dev)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(2_000_000_000)  # about a second on an H100: the allreduce waits for it
    h1 = hvd.allreduce_async_(x, op=hvd.Sum, name="lane.order.ar")
    time.sleep(0.2)  # the runtime has queued the allreduce on the GPU by now
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        h2 = hvd.allgather_async(x, name="lane.order.ag")
    gathered = hvd.synchronize(h2).cpu()
    hvd.synchronize(h1)
    reduced = sum(make(k, (1 << 16,), "float32", 7) for k in range(n))
    return torch.allclose(gathered, torch.cat([reduced] * n), rtol=1e-6, atol=1e-6)


@pytest.mark.gpus(2)  # on one rank the allreduce leaves the tensor as it was
def test_a_gather_waits_for_the_other_lanes_writer():
    assert all(shared_pool(2, env=LANE_ENV).run(_gather_after_allreduce_on_the_other_lane))


@pytest.mark.parametrize("mode", ["plain", "overlap"])
def test_stage2_on_the_gather_lane_matches_the_reference(gpus_lane, mode):
    for on_cuda, errs in gpus_lane.run(_zero_on_gpu, 2, mode):
        assert on_cuda
        assert all(e < 1e-5 for e in errs), errs


def test_stage3_on_the_gather_lane_matches_the_reference(gpus_lane):
    check_stage3_trains_to_the_reference(gpus_lane)


def _streams_of_kernels():
    dev, n = hvd.device(), hvd.size()
    grads = torch.randn(n * (64 << 20), device=dev)  # 256 MiB per rank to reduce-scatter
    params = torch.randn(32 << 20, device=dev)
    out = []

    def work():
        h = hvd.reducescatter_async(grads, name="lane.prof.rs")
        g = hvd.allgather_async(params, name="lane.prof.ag")
        out.extend([hvd.synchronize(h), hvd.synchronize(g)])
    work()  # warm: communicators and buffers
    events = profiled_events(work, dev)
    streams = {}
    for e in events:
        if e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            kind = "ag" if "allgather" in e["name"].lower() else "rs" if "reducescatter" in e["name"].lower() else None
            if kind:
                streams.setdefault(kind, set()).add(e["args"].get("stream"))
    return {k: sorted(v) for k, v in streams.items()}


@pytest.mark.gpus(2)
def test_on_two_gpus_gathers_and_reductions_run_on_different_streams():
    for streams in shared_pool(2, env=LANE_ENV).run(_streams_of_kernels):
        assert set(streams) == {"ag", "rs"}, streams
        assert not set(streams["ag"]) & set(streams["rs"]), streams
