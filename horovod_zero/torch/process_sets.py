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
This module is the sets themselves and how an op names its set; registering them
(collective) is job.py's.
"""

from typing import Optional, Sequence

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
