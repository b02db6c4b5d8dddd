"""ZeRO's settings: every HOROVOD_ZERO_* variable the optimizer uses, read and
checked once, when an optimizer is built, by the "zero" rows of horovod_zero/settings.py
(the one table of the package's variables, their defaults and accepted values)."""

from dataclasses import dataclass
from typing import Mapping, Optional

from horovod_zero import settings


@dataclass(frozen=True)
class ZeroConfig:
    bucket_bytes: int                # HOROVOD_ZERO_BUCKET_BYTES: gradients per grouped reduce-scatter
    downcast: bool                   # HOROVOD_ZERO_DOWNCAST: cast to param_dtype in the gather's copy-in
    init_chunk_bytes: Optional[int]  # HOROVOD_ZERO_INIT_CHUNK_BYTES: force the host-staged init
    prefetch: int                    # HOROVOD_ZERO_PREFETCH: stage 3 units gathered ahead
    fused_step: bool                 # HOROVOD_ZERO_FUSED_STEP: Adam/AdamW masters stepped by the fused kernel
    step_chunk_bytes: int            # HOROVOD_ZERO_STEP_CHUNK_BYTES: masters stepped at a time (and gathered: stages 1-2)
    master_adam: bool                # HOROVOD_ZERO_MASTER_ADAM: CUDA Adam from the uncast reduced gradients

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ZeroConfig":
        return cls(**settings.read_section("zero", env))
