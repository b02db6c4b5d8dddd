"""Timing helpers shared by the benchmarks: device-synchronized medians."""

import statistics
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn, iters, warmup=3, before_each=None):
    """Median wall time of fn() over `iters` runs after `warmup`, device-synchronized;
    before_each() (e.g. a barrier) runs untimed before every timed run."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if before_each is not None:
            before_each()
            sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
