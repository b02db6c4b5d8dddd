"""The gradient bucket size and stage 3's prefetch depth, as HOROVOD_AUTOTUNE tunes
them while the job runs.

[Note: tuned ZeRO settings]
Rank 0's autotuner (csrc/autotune/autotuner.h) may change both between its samples.
Every rank's runtime applies a new setting in the same negotiation cycle, but that
cycle falls anywhere in a step, at a different point on each rank. A bucket size that
changed halfway through backward on one rank only would still reduce correctly (each
reduction is named by its parameter, not by its bucket), and so would an uneven
prefetch (gathers are matched by name too), but the ranks would submit different
groups and fuse them differently. So the optimizer changes them at step() only: the
step's one small agreement on the reductions (core/reduce.py, [Note: one count of
reductions on every rank]) also carries each rank's newest generation of tuned
settings, and every rank takes the settings of the oldest of those, which every rank
has reached (the runtime keeps each generation: TunedHistory). Once the agreed
generation is the final one (the tuning has ended) the extra element is dropped, and
the step is as without autotuning. A setting given explicitly in the environment is
held constant, as Horovod holds explicit settings; without HOROVOD_AUTOTUNE none of
this runs."""

from horovod_zero import settings

BUCKET = "HOROVOD_ZERO_BUCKET_BYTES"
PREFETCH = "HOROVOD_ZERO_PREFETCH"


class ZeroTuning:
    """The values in force (bucket_bytes, prefetch) and, while tuning, the rows the
    step's agreement carries. `runtime`: the C++ runtime (its tuned(generation))."""

    def __init__(self, config, stage, runtime):
        self.bucket_bytes = config.bucket_bytes
        self.prefetch = config.prefetch
        tuned = runtime.tuned() is not None
        fixed = settings.explicitly_set((BUCKET, PREFETCH))
        self._bucket = tuned and stage >= 2 and BUCKET not in fixed  # stage 1 reduces everything at once
        self._prefetch = tuned and stage == 3 and PREFETCH not in fixed
        self._runtime = runtime if self._bucket or self._prefetch else None
        if self._runtime is not None:
            runtime.use_zero_knobs(bucket=self._bucket, prefetch=self._prefetch)

    @property
    def settled(self):
        """Whether these values stay: no tuning, or its final settings agreed."""
        return self._runtime is None

    def rows(self):
        """What this rank adds to the step's agreement, which takes the maximum of each
        element over the ranks: its newest generation, negated. The same on every rank:
        nothing once the agreed generation was the final one."""
        if self._runtime is None:
            return []
        return [[-self._runtime.tuned()["generation"]]]

    def adopt(self, agreed):
        """`agreed`: the agreement's result for rows()."""
        if not agreed or not agreed[0]:
            return
        values = self._runtime.tuned(int(-agreed[0][0]))
        if values is None:  # cannot happen: every rank has reached the oldest generation
            return
        if self._bucket:
            self.bucket_bytes = values["zero_bucket_bytes"]
        if self._prefetch:
            self.prefetch = values["zero_prefetch"]
        if not values["tuning"]:
            self._runtime = None
