"""What changes the job, collectively (every rank calls these, in the same order):
init(), which joins the job and registers the process sets it is given, and
add_process_set() / remove_process_set() while it runs.

Adding a set: every rank first checks, with one allgather in the global set, that
all ranks ask for the same change (so a mismatch is an error on every rank, never
a hang); the set's members then build its transports (a Gloo group of its ranks,
and a shared-memory segment when the global set negotiates through one); the
runtime then switches every rank to the new table at one global cycle
([Note: process sets] in csrc/runtime/process_set.h)."""

from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from horovod_zero import settings
from horovod_zero.runner.rendezvous import make_group_backend
from horovod_zero.torch import basics
from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.process_sets import ProcessSet, global_process_set

_DYNAMIC_REFUSED = (
    "hvd.{what}() changes process sets while the job runs, which needs dynamic process sets: set "
    "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets=\"dynamic\"). Sets known at the start can "
    "be passed to hvd.init(process_sets=[...]) instead.")

# What a change is, in the rows ranks compare (_agree).
_INIT, _ADD, _REMOVE = 0, 1, 2


def init(process_sets=None):
    """Joins the job described by the launcher's environment (horovodrun, torchrun,
    or none: size 1) and starts the background runtime. Calling it again while
    initialized does nothing.

    process_sets, as in Horovod: a list of hvd.ProcessSet to register besides
    hvd.global_process_set (every rank passes the same ones), or "dynamic" to allow
    hvd.add_process_set() and hvd.remove_process_set() later, as
    HOROVOD_DYNAMIC_PROCESS_SETS=1 does (see process_sets.py)."""
    dynamic_asked = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    if isinstance(process_sets, str) and not dynamic_asked:
        raise ValueError(f"hvd.init(process_sets={process_sets!r}): pass a list of hvd.ProcessSet or \"dynamic\".")
    with basics._state.lock:
        if basics._state.runtime is not None:
            return
        config = settings.read()  # every HOROVOD_* variable; a bad one is refused before anything starts
        basics._start(config)
    try:
        _on_init(basics._state.world.size, config.dynamic_process_sets or dynamic_asked,
                       None if dynamic_asked else process_sets)
    except BaseException:
        # Every rank fails alike (the sets are checked collectively), and init() may be
        # called again: this frame, which the exception keeps, holds no store.
        basics.shutdown()
        raise


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
    n = basics.size()
    state = basics._state
    row = torch.full((6 + n,), -1, dtype=torch.int64)
    row[0], row[1], row[2], row[3] = kind, int(not refused), value, len(ranks)
    if ranks:
        row[6:6 + len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    name = f"hvd.process_set_change.{state.process_set_changes}"
    state.process_set_changes += 1
    rows = ops.synchronize(ops._allgather_async(row.view(1, -1), name, None)).tolist()
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
    # No local holds the transports: a failure's traceback must not keep the store alive.
    ops.synchronize(basics._runtime().add_process_set(new_id, ps.ranks, *_transports(new_id, ps.ranks)))
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
    ops.synchronize(basics._runtime().remove_process_set(set_id))
    basics._state.process_sets.pop(set_id, None)
    process_set.process_set_id = None
    process_set._rank = None
    return True
