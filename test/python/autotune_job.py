"""A job of repeated allreduces run until HOROVOD_AUTOTUNE's tuning ends, used by
test_autotune.py in processes of its harness and, as a script, under horovodrun.
Every result is checked against the sum plain torch computes from every rank's
inputs: the tuner may change the speed, never a value."""

import sys

import torch

import horovod_zero.torch as hvd

# Tensors of 16 KiB to 1 MiB, 2.1 MiB in all: fusion thresholds of 1 and 2 MiB split them
# into several collectives, 3 MiB and more fuse them into one.
SIZES = [1 << 12, 1 << 14, 3 << 14, 1 << 16, 1 << 18, 5 << 15]


def inputs(rank, step):
    """Rank `rank`'s tensors at `step`: small integers, so every sum is exact."""
    return [((torch.arange(n) * (rank + 3) + 7 * step + i) % 2001 - 1000).float() for i, n in enumerate(SIZES)]


def tuning_done():
    """Whether every rank has the tuner's final setting (one agreement per step, so
    that every rank stops at the same step)."""
    final = 0.0 if hvd.runtime_info()["autotune"]["tuning"] else 1.0
    return hvd.allreduce(torch.tensor([final]), op=hvd.Min, name="autotune_job.done").item() == 1.0


def run(max_steps=400):
    """Steps until the tuning ends; the number of steps, and the settings in force."""
    size = hvd.size()
    for step in range(max_steps):
        got = hvd.grouped_allreduce(inputs(hvd.rank(), step), op=hvd.Sum, name="autotune_job.t")
        want = [sum(ts) for ts in zip(*(inputs(r, step) for r in range(size)))]
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"step {step}: an allreduce differs from plain torch's sum"
        if tuning_done():
            info = hvd.runtime_info()
            return dict(rank=hvd.rank(), steps=step + 1, fusion_threshold=info["fusion_threshold"], cycle_time_ms=info["cycle_time_ms"],
                        autotune=info["autotune"])
    raise AssertionError(f"the tuning did not end within {max_steps} steps: {hvd.runtime_info()['autotune']}")


def launched():
    """harness.launch's entry: init, run, shutdown."""
    hvd.init()
    try:
        return run()
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    out = launched()
    sys.stdout.write("LAUNCH_OK " + " ".join(f"{k}={v}" for k, v in out.items() if k != "autotune")
                     + "\n")
    sys.stdout.flush()
