"""Timing helpers shared by the benchmarks: device-synchronized medians."""

import statistics
import time

import torch

import horovod_zero.torch as hvd


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


def back_to_back_time(fn, iters):
    """Mean wall time of fn() over `iters` runs with no synchronization between them, as a
    training loop runs: the CPU queues the next step while the GPU finishes this one, so
    where the host sets the pace (micro-batch 1) its work hides under the GPU's and the
    reverse. median_time() synchronizes after every run and adds both."""
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def run_until_tuned(step_fn, max_steps):
    """With HOROVOD_AUTOTUNE=1: runs step_fn() until the autotuner has kept its best
    setting on every rank, and one step more (a ZeRO optimizer takes the final bucket
    size and prefetch depth at its next step). Returns the steps run and the settings
    kept; without autotuning (0, None) at once."""
    if hvd.runtime_info()["autotune"] is None:
        return 0, None
    for k in range(max_steps):
        step_fn()
        final = 0.0 if hvd.runtime_info()["autotune"]["tuning"] else 1.0
        if hvd.allreduce(torch.tensor([final]), op=hvd.Min, name="bench.tuned").item() == 1.0:
            step_fn()
            return k + 2, hvd.runtime_info()["autotune"]
    raise SystemExit(f"The autotuner did not finish within {max_steps} steps: raise --tune-max-steps, or lower "
                     "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE / _BAYES_OPT_MAX_SAMPLES / _CONFIRM_ROUNDS.")


def tuned_text(steps, tuned):
    """One line's account of what the autotuner kept."""
    if tuned is None:
        return ""
    return (f"autotuned in {steps} steps: fusion threshold {tuned['fusion_threshold'] / 2**20:.0f} MiB, cycle time "
            f"{tuned['cycle_time_ms']:.3g} ms, ZeRO bucket {tuned['zero_bucket_bytes'] / 2**20:.0f} MiB, prefetch "
            f"{tuned['zero_prefetch']}")
