"""Who this process is in the job, read from the launcher's environment.

Each launcher names rank, size and locality in variables of its own; one reader
per launcher turns them into a World. The first launcher whose variables are
present wins, in the order of `_READERS`: horovodrun and torchrun first, because
a job they start from inside an allocation (mpirun's or Slurm's) still carries
the outer launcher's variables.
"""

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
    launcher: str  # "horovodrun", "torchrun", "mpirun", "srun" or "single"


def _int(env, name, default=None):
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"{name} is not set; the launcher did not provide it.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; the launcher set it wrongly.") from None


def _horovodrun(env):
    size = _int(env, "HOROVOD_SIZE")
    return World(
        rank=_int(env, "HOROVOD_RANK"),
        size=size,
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
        local_size=_int(env, "HOROVOD_LOCAL_SIZE", size),
        cross_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
        cross_size=_int(env, "HOROVOD_CROSS_SIZE", 1),
        launcher="horovodrun",
    )


def _consecutive(env, launcher, rank, size, local_rank, local_size, node=None):
    """A launcher that places consecutive ranks on one node: without a node index
    variable (Open MPI has none; its default mapping is by slot), the node of a
    rank is rank // local_size."""
    size_ = _int(env, size)
    rank_ = _int(env, rank)
    local_size_ = _int(env, local_size, size_)
    return World(
        rank=rank_,
        size=size_,
        local_rank=_int(env, local_rank, rank_ % local_size_),
        local_size=local_size_,
        cross_rank=_int(env, node, rank_ // local_size_) if node else rank_ // local_size_,
        cross_size=max(1, size_ // local_size_),
        launcher=launcher,
    )


def _torchrun(env):
    return _consecutive(env, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _mpirun(env):
    return _consecutive(env, "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


def slurm_tasks_per_node(value: str) -> list:
    """Slurm's compressed task counts, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts


def _srun(env):
    size = _int(env, "SLURM_NTASKS")
    rank = _int(env, "SLURM_PROCID")
    node = _int(env, "SLURM_NODEID", 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    counts = slurm_tasks_per_node(per_node) if per_node else [size]
    return World(
        rank=rank,
        size=size,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_size=counts[node] if node < len(counts) else counts[-1],
        cross_rank=node,
        cross_size=len(counts),
        launcher="srun",
    )


# (variables that mark the launcher, reader), in order of precedence.
_READERS = (
    (("HOROVOD_RANK", "HOROVOD_SIZE"), _horovodrun),
    (("RANK", "WORLD_SIZE"), _torchrun),
    (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), _mpirun),
    (("SLURM_PROCID", "SLURM_NTASKS"), _srun),
)


def detect_world(env=None) -> World:
    """horovodrun, torchrun, Open MPI's mpirun or Slurm's srun, by their own
    variables; with none of them, this is a job of size 1."""
    env = os.environ if env is None else env
    for names, reader in _READERS:
        if all(n in env for n in names):
            world = reader(env)
            _check(world)
            return world
    return World(0, 1, 0, 1, 0, 1, "single")


def _check(w: World):
    if not (0 <= w.rank < w.size and 0 <= w.local_rank < w.local_size and 0 <= w.cross_rank < w.cross_size):
        raise ValueError(
            f"The {w.launcher} environment is inconsistent: rank {w.rank} of {w.size}, local rank "
            f"{w.local_rank} of {w.local_size}, node {w.cross_rank} of {w.cross_size}. Check the launcher's options."
        )
