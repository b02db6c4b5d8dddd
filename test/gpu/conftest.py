"""Selects the GPU tests by the CUDA GPUs this machine has.

Markers (pytest.ini):
  gpu             needs one CUDA GPU (and, unless also cpu_only_build, a CUDA build)
  gpus(n)         needs n CUDA GPUs: a job of n ranks, one on each
  cpu_only_build  checks a build without CUDA (-DHVDZ_CUDA=OFF); needs a GPU too

A test this machine cannot run is deselected, not skipped, so that a run reports
only what it could have run: without GPUs none of these, on one GPU those of one
rank, on two or more all but cpu_only_build (which runs where the build has no CUDA).

HVDZ_TEST_GPUS=n makes the selection count n GPUs, to check it with
`pytest --collect-only` on a machine that has fewer; nothing else reads it.
"""

import functools
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "python"))

FAKE_GPUS_ENV = "HVDZ_TEST_GPUS"


@functools.lru_cache(maxsize=None)
def _gpu_count():
    forced = os.environ.get(FAKE_GPUS_ENV)
    if forced:
        return int(forced)
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


@functools.lru_cache(maxsize=None)
def _cuda_build():
    """Whether horovod_zero runs CUDA tensors here: asked of a fresh single process,
    since this one must never call hvd.init() (test_errors checks the refusal before it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE")}
    code = "import horovod_zero.torch as hvd; hvd.init(); print(int(hvd.cuda_built())); hvd.shutdown()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not ask horovod_zero whether it was built with CUDA:\n{out.stderr}")
    return out.stdout.strip().splitlines()[-1] == "1"


def gpus_needed(item):
    """The CUDA GPUs an item needs: the largest of its gpus(n) markers, 1 for gpu, else 0."""
    needed = 1 if item.get_closest_marker("gpu") else 0
    for mark in item.iter_markers("gpus"):
        needed = max(needed, mark.args[0])
    return needed


def _runnable(item):
    needed = gpus_needed(item)
    if needed > _gpu_count():
        return False
    if item.get_closest_marker("cpu_only_build"):
        return not _cuda_build()
    return True


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (keep if _runnable(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    forced = f" ({FAKE_GPUS_ENV})" if os.environ.get(FAKE_GPUS_ENV) else ""
    return f"CUDA GPUs: {_gpu_count()}{forced}; GPU tests needing more are deselected"


def pytest_sessionfinish(session, exitstatus):
    from harness import close_shared_pools
    close_shared_pools()
