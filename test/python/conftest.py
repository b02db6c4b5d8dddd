import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import RankPool  # noqa: E402

_pools = {}


def pool(size, fusion=True):
    """A RankPool shared by every test that asks for the same configuration."""
    key = (size, fusion)
    if key not in _pools:
        env = {} if fusion else {"HOROVOD_FUSION_THRESHOLD": "0"}
        _pools[key] = RankPool(size, env)
    return _pools[key]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request):
    return pool(request.param)


@pytest.fixture(params=[(2, True), (3, True), (2, False)], ids=["2ranks", "3ranks", "2ranks-nofusion"])
def ranks_fusion(request):
    return pool(*request.param)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
