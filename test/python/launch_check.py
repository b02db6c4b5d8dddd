"""Run by test_launch.py under each launcher: joins the job, allreduces rank + 1,
and prints where it is and the settings the runtime took from the launcher."""

import os
import sys

import torch

import horovod_zero.torch as hvd
from horovod_zero.torch.basics import _world

hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="launch_check").item()
info = hvd.runtime_info()
fields = dict(
    rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
    cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(), launcher=_world().launcher, sum=total,
    fusion_threshold=info["fusion_threshold"], cycle_time_ms=info["cycle_time_ms"],
    cache_capacity=info["cache_capacity"], timeline=info["timeline"], control_plane=info["control_plane"],
    log_level=os.environ.get("HOROVOD_LOG_LEVEL", ""),
    threads=torch.get_num_threads(), usable_cores=len(os.sched_getaffinity(0)),
)
# One write per line: ranks share the launcher's stdout, and print() writes the newline separately.
sys.stdout.write("LAUNCH_OK " + " ".join(f"{k}={v}" for k, v in fields.items()) + "\n")
sys.stdout.flush()
hvd.shutdown()
