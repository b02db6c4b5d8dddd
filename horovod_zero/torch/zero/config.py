"""ZeRO's settings from the environment: every HOROVOD_ZERO_* variable the
optimizer uses is read and checked here, once, when an optimizer is built."""

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class ZeroConfig:
    bucket_bytes: int = 32 << 20          # HOROVOD_ZERO_BUCKET_BYTES: gradients per grouped reduce-scatter
    downcast: bool = True                 # HOROVOD_ZERO_DOWNCAST: cast to param_dtype in the gather's copy-in
    init_chunk_bytes: Optional[int] = None  # HOROVOD_ZERO_INIT_CHUNK_BYTES: force the host-staged init
    prefetch: int = 1                     # HOROVOD_ZERO_PREFETCH: stage 3 units gathered ahead

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "ZeroConfig":
        return cls(bucket_bytes=_count(env, "HOROVOD_ZERO_BUCKET_BYTES", cls.bucket_bytes),
                   downcast=_flag(env, "HOROVOD_ZERO_DOWNCAST", cls.downcast),
                   init_chunk_bytes=_count(env, "HOROVOD_ZERO_INIT_CHUNK_BYTES", None, minimum=1),
                   prefetch=_count(env, "HOROVOD_ZERO_PREFETCH", cls.prefetch))


def _count(env, name, default, minimum=0):
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={raw!r}: expected a whole number of at least {minimum}; unset it for the default "
                         f"({default}).")
    return value


def _flag(env, name, default):
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1; unset it for the default ({int(default)}).")
    return raw == "1"
