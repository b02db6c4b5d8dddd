import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "python"))


def _gpus():
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def pytest_sessionfinish(session, exitstatus):
    from harness import close_shared_pools
    close_shared_pools()


def pytest_collection_modifyitems(config, items):
    if _gpus() >= 2:
        return
    skip = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
