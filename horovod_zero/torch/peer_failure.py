"""Who failed first: a rank that dies because a peer failed lets the launcher see that peer's
exit first.

horovodrun and Open MPI's mpirun name the first rank that exited non-zero ("Process name: 1,
Exit code: 3") and stop the others. When rank 1 fails, the others hear of it at once (its
runtime says it shut down, or its connections close) and raise HorovodInternalError; a rank
that dies of that error used to exit while rank 1 was still exiting, so the launcher named it
("Process name: 0, Exit code: 1") and rank 1's own code was lost. At exit, such a rank now waits
up to GRACE_SECONDS; both launchers end it as soon as they have seen the failed rank's exit, so
the wait lasts only as long as that exit takes. Elastic jobs never wait here: they recover from
a peer's failure (hvd.elastic.run) instead of exiting, and that must stay fast.
"""

import re
import sys
import time

from horovod_zero.native import core as _core

# How long a rank dying of a peer's failure waits before exiting: long enough for the failed
# rank's own exit (interpreter teardown, CUDA and NCCL teardown on GPUs), short enough that a
# launcher that does not stop the other ranks ends the job soon after.
GRACE_SECONDS = 5.0
# The core's messages when this rank's runtime stopped because of other ranks: one shut down
# while this rank waited on it, or the transport failed (csrc/runtime/runtime.cc, Loop and
# PeersLeft); an op submitted after that is refused with the same reason, after its name
# (Runtime::Enqueue).
_PEER_STOPPED = re.compile(r"(Cannot submit '.*?': )?horovod_zero stopped")


def caused_by_peer(exc) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is this rank's
    runtime stopping because of another rank."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _core.HorovodInternalError) and _PEER_STOPPED.match(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def exit_grace_seconds(exc, elastic: bool) -> float:
    """How long a process ending with the uncaught exception `exc` waits (0: exits at once)."""
    return GRACE_SECONDS if not elastic and caused_by_peer(exc) else 0.0


def wait_at_exit(elastic: bool) -> None:
    """Registered with atexit (basics.py): the interpreter has printed the uncaught exception
    (sys.last_exc from Python 3.12, sys.last_value before) and is about to exit."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    grace = exit_grace_seconds(exc, elastic)
    if grace:
        time.sleep(grace)
