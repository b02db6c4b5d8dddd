import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from harness import close_shared_pools, shared_pool  # noqa: E402


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request):
    return shared_pool(request.param)


@pytest.fixture(params=[(2, True), (3, True), (2, False)], ids=["2ranks", "3ranks", "2ranks-nofusion"])
def ranks_fusion(request):
    return shared_pool(*request.param)


def pytest_sessionfinish(session, exitstatus):
    close_shared_pools()
