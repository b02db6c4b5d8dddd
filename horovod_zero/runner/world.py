"""Who this process is in the job, read from the launcher's environment."""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    launcher: str  # "horovodrun", "torchrun" or "single"


def _int(env, name, default=None):
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"{name} is not set; the launcher did not provide it.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer.") from None


def detect_world(env=None) -> World:
    """horovodrun sets HOROVOD_RANK/SIZE/...; torchrun sets RANK/WORLD_SIZE/...;
    with neither, this is a job of size 1."""
    env = os.environ if env is None else env
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        size = _int(env, "HOROVOD_SIZE")
        local_size = _int(env, "HOROVOD_LOCAL_SIZE", size)
        return World(
            rank=_int(env, "HOROVOD_RANK"),
            size=size,
            local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
            local_size=local_size,
            cross_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
            cross_size=_int(env, "HOROVOD_CROSS_SIZE", 1),
            launcher="horovodrun",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        size = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_size = _int(env, "LOCAL_WORLD_SIZE", size)
        return World(
            rank=rank,
            size=size,
            local_rank=_int(env, "LOCAL_RANK", rank % local_size),
            local_size=local_size,
            cross_rank=_int(env, "GROUP_RANK", rank // local_size),
            cross_size=max(1, size // local_size),
            launcher="torchrun",
        )
    return World(0, 1, 0, 1, 0, 1, "single")
