"""The test harness itself: a shared pool whose ranks hung in one test is replaced,
so that the hang fails that test alone and not every later test of the run."""

import time

import pytest

import horovod_zero.torch as hvd
from harness import shared_pool


def _rank_1_never_answers():
    if hvd.rank() == 1:
        time.sleep(3600)
    return hvd.rank()


def _ranks():
    return hvd.rank()


def test_a_pool_that_timed_out_is_replaced_by_a_working_one():
    hung = shared_pool(2, env={"HARNESS_CHECK": "1"})
    with pytest.raises(TimeoutError, match="not every rank answered"):
        hung.run(_rank_1_never_answers, timeout=5)
    fresh = shared_pool(2, env={"HARNESS_CHECK": "1"})
    assert fresh is not hung and fresh.run(_ranks) == [0, 1]
