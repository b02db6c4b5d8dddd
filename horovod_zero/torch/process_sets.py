"""Process sets, with Horovod's names and semantics: subsets of the job's ranks that
run collectives of their own, passed to any collective as process_set=.

    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    ps = even if hvd.rank() % 2 == 0 else odd
    hvd.allreduce(t, process_set=ps)        # averaged over the set's ranks

With HOROVOD_DYNAMIC_PROCESS_SETS=1 (or hvd.init(process_sets="dynamic")) sets can
also be added and removed while the job runs, with hvd.add_process_set() and
hvd.remove_process_set(). Like hvd.init(), both are collective: every rank calls
them, with the same sets, in the same order. Ranks are always the job's ranks
(hvd.rank()), also for a broadcast's root_rank; ps.rank() is a rank's place in the
set, which is the order of an allgather's output.

How the runtime runs them: [Note: process sets] in csrc/runtime/process_set.h.
Adding a set: every rank first checks, with one allgather in the global set, that
all ranks ask for the same change (so a mismatch is an error on every rank, never
a hang); the set's members then build its transports (a Gloo group of its ranks,
and a shared-memory segment when the global set negotiates through one); the
runtime then switches every rank to the new table at one global cycle.
"""

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from horovod_zero.runner.rendezvous import make_group_backend
from horovod_zero.torch import basics


class ProcessSet:
    """A set of the job's ranks that run collectives together.

    Build it from a list of ranks, register it with hvd.init(process_sets=[...]) or
    hvd.add_process_set(), then pass it as process_set= to collectives (every rank of
    the set must call them; the others must not). process_set_id is None until it is
    registered, and again once it is removed or the job shuts down."""

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError(f"ProcessSet takes a list of ranks; got {ranks!r}. (horovod_zero has no MPI, so no "
                             "MPI communicator either.)")
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of ranks (ints); got {ranks!r}.")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet got ranks {ranks!r}, some more than once: list each rank once.")
        self.ranks = sorted(ranks)
        self.process_set_id = None
        self._rank = None  # this process's place in the set, once registered

    def size(self) -> Optional[int]:
        """The number of ranks in the set; None while it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's place in the set (the order of an allgather's output); None
        while it is not registered. Raises ValueError on a rank outside the set.
        Collectives' root_rank is the job's rank, not this one."""
        if self.process_set_id is None:
            return None
        if self._rank is None:
            raise ValueError(f"Rank {basics.rank()} is not in {self}: it has no rank in it. Test included() first.")
        return self._rank

    def included(self) -> Optional[bool]:
        """Whether this process is one of the set's ranks (None without ranks)."""
        if self.ranks is None:
            return None
        return basics.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


# Every job's ranks, id 0: its ranks are filled in by hvd.init().
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_DYNAMIC_REFUSED = (
    "hvd.{what}() changes process sets while the job runs, which needs dynamic process sets: set "
    "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets=\"dynamic\"). Sets known at the start can "
    "be passed to hvd.init(process_sets=[...]) instead.")

# What a change is, in the rows ranks compare (_agree).
_INIT, _ADD, _REMOVE = 0, 1, 2


# --- what the collectives use --------------------------------------------------------

def _id(process_set) -> int:
    """The id the core knows `process_set` by; refuses what is not a registered set."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set takes an hvd.ProcessSet; got {type(process_set).__name__}.")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or "
                         "hvd.add_process_set() before using it (a removed set cannot be used any more).")
    return process_set.process_set_id


def _size(process_set) -> int:
    """The number of ranks an op on `process_set` runs over."""
    return basics.size() if _id(process_set) == 0 else len(process_set.ranks)


def _rank(process_set) -> int:
    """This process's place in `process_set`."""
    if _id(process_set) == 0:
        return basics.rank()
    return process_set.rank()


def _world_rank(process_set, set_rank: int) -> int:
    return set_rank if _id(process_set) == 0 else process_set.ranks[set_rank]


# --- registration ----------------------------------------------------------------------

def _on_init(world_size: int, dynamic: bool, process_sets) -> None:
    """Called by hvd.init() once the runtime runs: registers `process_sets`."""
    global_process_set.ranks = list(range(world_size))
    state = basics._state
    state.dynamic_process_sets = dynamic
    state.process_sets = {0: global_process_set}
    state.next_process_set_id = 1
    state.process_set_changes = 0
    if process_sets is None:
        return
    process_sets = list(process_sets)
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...) takes a list of hvd.ProcessSet or \"dynamic\"; got a "
                             f"{type(ps).__name__} in the list.")
    # Every rank must pass as many sets: compared once, so that none waits for a set
    # the others do not add.
    _agree("hvd.init(process_sets=...)", _INIT, len(process_sets))
    for ps in process_sets:
        _add(ps, "hvd.init(process_sets=...)")


def _on_shutdown() -> None:
    """Sets belong to one init(): they must be passed to the next one again."""
    for ps in getattr(basics._state, "process_sets", {}).values():
        if ps is not global_process_set:
            ps.process_set_id = None
            ps._rank = None
    basics._state.process_sets = {}


def _problem(ranks, world_size) -> Optional[str]:
    bad = [r for r in ranks if not 0 <= r < world_size]
    if not ranks:
        return "a process set needs at least one rank"
    if bad:
        return f"ranks {bad} are not ranks of this job of size {world_size}"
    return None


def _agree(what: str, kind: int, value: int, ranks=(), refused: bool = False) -> None:
    """Checks, with one allgather in the global set, that every rank asks for the same
    change (`kind`, `value`, `ranks`); raises the same ValueError on every rank when
    they differ or one of them `refused` it after its own checks."""
    from horovod_zero.torch import mpi_ops
    n = basics.size()
    state = basics._state
    row = torch.full((6 + n,), -1, dtype=torch.int64)
    row[0], row[1], row[2], row[3] = kind, int(not refused), value, len(ranks)
    if ranks:
        row[6:6 + len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    name = f"hvd.process_set_change.{state.process_set_changes}"
    state.process_set_changes += 1
    rows = mpi_ops.allgather(row.view(1, -1), name=name).tolist()
    others = [k for k, r in enumerate(rows) if r[1] == 0 and k != basics.rank()]
    if others and not refused:
        raise ValueError(f"{what} was refused on ranks {others} (their own error says why); every rank must ask for "
                         "the same, valid change.")
    if not refused and any(r != rows[0] for r in rows):
        asked = "; ".join(f"rank {k}: {_describe(r)}" for k, r in enumerate(rows))
        raise ValueError(f"{what} was called differently on the ranks ({asked}). Every rank must add and remove the "
                         "same process sets, in the same order.")


def _describe(row) -> str:
    kind, value, count = row[0], row[2], row[3]
    if kind == _INIT:
        return f"{value} process sets in hvd.init()"
    if kind == _ADD:
        return f"add ranks {row[6:6 + count]}"
    return f"remove process set {value}"


def _add(ps, what: str) -> ProcessSet:
    """The collective part of adding `ps` (a ProcessSet or a list of ranks)."""
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    state = basics._state
    problem = _problem(ps.ranks, basics.size())
    if ps.process_set_id is not None:
        problem = f"{ps} is registered already"
    new_id = state.next_process_set_id
    _agree(what, _ADD, new_id, [] if problem else ps.ranks, refused=problem is not None)
    if problem:
        raise ValueError(f"{what}: {problem}.")
    state.next_process_set_id += 1
    twin = next((p for p in state.process_sets.values() if p.ranks == ps.ranks), None)
    if twin is not None:
        raise ValueError(f"{what}: a process set with ranks {ps.ranks} exists already ({twin}); use that one.")
    from horovod_zero.torch import mpi_ops
    # No local holds the transports: a failure's traceback must not keep the store alive.
    mpi_ops.synchronize(basics._runtime().add_process_set(new_id, ps.ranks, *_transports(new_id, ps.ranks)))
    ps.process_set_id = new_id
    me = basics.rank()
    ps._rank = ps.ranks.index(me) if me in ps.ranks else None
    state.process_sets[new_id] = ps
    return ps


def _transports(set_id: int, ranks: List[int]):
    """On a member: a Gloo group of the set's ranks, built on the job's store, and the
    shared-memory segment's name when the global set negotiates through one (else
    ""). (None, "") elsewhere."""
    me = basics.rank()
    if me not in ranks:
        return None, ""
    state = basics._state
    store = dist.PrefixStore(f"process_set.{set_id}", state.store)
    rank, size = ranks.index(me), len(ranks)
    backend = make_group_backend(store, rank, size, state.transport_timeout_seconds, state.gloo_iface)
    shm = ""
    if state.shm_name and size > 1:
        if rank == 0:
            store.set("shm_control", f"{state.shm_name}.{set_id}")
        shm = store.get("shm_control").decode()
    return backend, shm


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Adds a process set while the job runs and returns it, registered (a list of
    ranks makes a new ProcessSet). Needs HOROVOD_DYNAMIC_PROCESS_SETS=1 or
    hvd.init(process_sets="dynamic"). Collective: every rank calls it with the same
    ranks, in the same order as its other additions and removals; no set with the
    same ranks may exist."""
    basics._runtime()
    if not basics._state.dynamic_process_sets:
        raise ValueError(_DYNAMIC_REFUSED.format(what="add_process_set"))
    return _add(process_set, "hvd.add_process_set()")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set added before (collective, like add_process_set()) and
    returns True; False for an unregistered set and for the global one. Ops of the
    set that have not run yet fail; the set's process_set_id becomes None."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes an hvd.ProcessSet; got {type(process_set).__name__}.")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    basics._runtime()
    if not basics._state.dynamic_process_sets:
        raise ValueError(_DYNAMIC_REFUSED.format(what="remove_process_set"))
    _agree("hvd.remove_process_set()", _REMOVE, set_id)
    from horovod_zero.torch import mpi_ops
    mpi_ops.synchronize(basics._runtime().remove_process_set(set_id))
    basics._state.process_sets.pop(set_id, None)
    process_set.process_set_id = None
    process_set._rank = None
    return True
