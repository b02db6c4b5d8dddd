"""Allgathers through the copy-engine window (HOROVOD_ZERO_CE_ALLGATHER_BYTES, see
[Note: copy-engine allgather]) on 1 and 2 GPUs, against plain-torch references: the
window is registered; grouped gathers with a cast and uneven dim 0, lone ones, and
ones too large for the window all match; many in flight at once reuse the one window
safely; ZeRO stage 3 trains to the CPU reference through it. On 2 GPUs the gathers
run with no NCCL allgather kernel at all. Each also with the gather lane
(HOROVOD_ZERO_GATHER_STREAM=1), whose communicator then holds the window."""

import pytest
import torch

import horovod_zero.torch as hvd
from gpu_trace import profiled_events
from harness import on_gpus, shared_pool
from refs import make
from test_gpu_stage3 import check_stage3_trains_to_the_reference

pytestmark = pytest.mark.gpu

WINDOW = 8 << 20
# A small fusion threshold, so that the many gathers below make many window ops; side copy
# streams for every other fused op, so that a window op moved onto them would race.
CE_ENV = {"HOROVOD_ZERO_CE_ALLGATHER_BYTES": str(WINDOW), "HOROVOD_FUSION_THRESHOLD": str(1 << 20),
          "HOROVOD_ZERO_COPY_STREAM_BYTES": "1"}


LANE_ENV = dict(CE_ENV, HOROVOD_ZERO_GATHER_STREAM="1")


@pytest.fixture(params=on_gpus(1, 2))
def gpus_ce(request):
    return shared_pool(request.param, env=CE_ENV)


@pytest.fixture(params=on_gpus(1, 2))
def gpus_ce_lane(request):
    return shared_pool(request.param, env=LANE_ENV)


def _gathers():
    n, r, dev = hvd.size(), hvd.rank(), hvd.device()
    hvd.collective_stats(reset=True)
    # fp32 masters gathered as bf16, dim 0 differing by rank, odd widths: fused
    ins = [[make(k, (k + 3 + i, 5 + i), "float32", 30 + i) for i in range(6)] for k in range(n)]
    got = hvd.grouped_allgather([t.to(dev) for t in ins[r]], output_dtype=torch.bfloat16, name="ce.cast")
    cast_ok = all(torch.equal(g.cpu(), torch.cat([ins[k][i] for k in range(n)]).bfloat16()) for i, g in enumerate(got))
    # a lone tensor that fits, and one too large for the window (kernels, in place)
    lone = hvd.allgather(make(r, (1000, 3), "float32", 40).to(dev), name="ce.lone")
    lone_ok = torch.equal(lone.cpu(), torch.cat([make(k, (1000, 3), "float32", 40) for k in range(n)]))
    big = hvd.allgather(make(r, (3 << 20,), "float32", 41).to(dev), name="ce.big")
    big_ok = torch.equal(big.cpu(), torch.cat([make(k, (3 << 20,), "float32", 41) for k in range(n)]))
    # 40 gathers in flight together: each window op must wait for the last one's copy out
    mine = [make(r, (65536 + 17 * i,), "bfloat16", 50 + i).to(dev) for i in range(40)]
    handles = [hvd.allgather_async(t, name=f"ce.flight.{i}") for i, t in enumerate(mine)]
    flight_ok = all(torch.equal(hvd.synchronize(h).cpu(),
                                torch.cat([make(k, (65536 + 17 * i,), "bfloat16", 50 + i) for k in range(n)]))
                    for i, h in enumerate(handles))
    gathers = sum(s["collectives"] for s in hvd.collective_stats() if s["op"] == "allgather")
    info = hvd.runtime_info()
    return cast_ok, lone_ok, big_ok, flight_ok, gathers, info["gather_window_bytes"], info["gather_lanes"]


def test_allgathers_through_the_window_match_torch(gpus_ce):
    for cast_ok, lone_ok, big_ok, flight_ok, gathers, window, lanes in gpus_ce.run(_gathers):
        assert (cast_ok, lone_ok, big_ok, flight_ok) == (True, True, True, True)
        assert window == WINDOW and lanes == 0
        assert gathers >= 6, gathers  # the 40 in flight took several window ops


def test_allgathers_through_the_gather_lanes_window_match_torch(gpus_ce_lane):
    for cast_ok, lone_ok, big_ok, flight_ok, gathers, window, lanes in gpus_ce_lane.run(_gathers):
        assert (cast_ok, lone_ok, big_ok, flight_ok) == (True, True, True, True)
        # One window; whose it is, the 2-GPU kernel test below tells (on the main
        # communicator the lane's gathers would run NCCL's kernels).
        assert window == WINDOW and lanes == 1
        assert gathers >= 6, gathers


def test_stage3_through_the_window_matches_the_reference(gpus_ce):
    check_stage3_trains_to_the_reference(gpus_ce)


def test_stage3_through_the_gather_lanes_window_matches_the_reference(gpus_ce_lane):
    check_stage3_trains_to_the_reference(gpus_ce_lane)


def _kernel_names():
    dev = hvd.device()
    x = torch.randn(1 << 20, device=dev)
    hvd.allgather(x, name="ce.warm")
    torch.cuda.synchronize(dev)
    out = []
    events = profiled_events(lambda: out.append(hvd.allgather(x, name="ce.profiled")), dev)
    ok = torch.equal(out[0].cpu(), torch.cat(hvd.allgather_object(x.cpu())))
    return ok, sorted({e["name"] for e in events if e.get("cat") == "kernel"})


@pytest.mark.gpus(2)
@pytest.mark.parametrize("env", [CE_ENV, LANE_ENV], ids=["main", "lane"])
def test_on_two_gpus_the_gather_runs_on_the_copy_engines(env):
    pool = shared_pool(2, env=env)
    for ok, kernels in pool.run(_kernel_names):
        assert ok
        assert not [k for k in kernels if "allgather" in k.lower()], kernels
        assert [k for k in kernels if "BatchedCopyKernel" in k], kernels  # the profile saw the gather's copies
