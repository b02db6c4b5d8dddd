"""A build without CUDA, on a machine with a GPU: a CUDA tensor is refused at the
call, with what to do, and CPU tensors keep working. run_on_gpu_machine.sh builds
with -DHVDZ_CUDA=OFF and runs this file (CPU_ONLY_BUILD=1); test/gpu/conftest.py
deselects it where the build has CUDA, and without a GPU. Both ranks run on the
CPU (Gloo) and make their CUDA tensor on GPU 0, so one GPU is enough."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch

pytestmark = [pytest.mark.gpu, pytest.mark.cpu_only_build]


def _refuses_cuda():
    hvd.init()
    if hvd.cuda_built():
        return "cuda build"
    try:
        hvd.allreduce(torch.ones(4, device="cuda:0"), name="cpu_only.cuda")
        refused = None
    except ValueError as e:
        refused = str(e)
    ok = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="cpu_only.cpu")
    hvd.shutdown()
    return refused, ok.tolist()


def test_cpu_only_build_refuses_cuda_tensors_with_what_to_do():
    out = launch(_refuses_cuda, 2)
    assert sorted(out) == [0, 1], out
    for status, value in out.values():
        assert status == "ok", value
        assert value != "cuda build", "selected for a build without CUDA, but this one runs CUDA tensors"
        refused, ok = value
        assert refused is not None, "a CUDA tensor was accepted by a build without CUDA"
        assert "'cpu_only.cuda'" in refused and "without CUDA" in refused and "move the tensor to the CPU" in refused
        assert ok == [2.0] * 4
