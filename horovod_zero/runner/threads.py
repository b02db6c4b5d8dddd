"""Threads per rank where the launcher leaves OMP_NUM_THREADS unset.

torch gives every process as many intra-op threads as the machine has cores. With several
ranks on a host that oversubscribes the cores: on 2 cores with 2 ranks, Horovod's synthetic
benchmark (resnet18, CPU) was reported at 2.8 images/s per rank instead of 8.3 with one thread
each (docs/benchmarks.md, "Threads per rank on the CPU").
torchrun sets OMP_NUM_THREADS=1 for each of several local workers; horovodrun, mpirun and srun
set nothing. Where the user set nothing either, hvd.init() gives each rank its share of the
cores it may run on: usable cores // local ranks (at least 1).
"""

import os
from typing import Optional


def default_threads(env, local_size: int, usable_cores: int) -> Optional[int]:
    """The intra-op threads for a rank among `local_size` on its host, or None to leave
    torch's setting alone (OMP_NUM_THREADS set, or alone on the host)."""
    if env.get("OMP_NUM_THREADS", "") != "" or local_size <= 1:
        return None
    return max(1, usable_cores // local_size)


def rank_threads(local_size: int) -> Optional[int]:
    """default_threads() for this process: its environment and the cores it may run on."""
    return default_threads(os.environ, local_size, len(os.sched_getaffinity(0)))
