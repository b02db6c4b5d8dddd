"""Horovod's hvd.start_timeline / hvd.stop_timeline: the timeline of HOROVOD_TIMELINE
for part of a run. Rank 0 writes it, as in Horovod; on the other ranks both calls
do nothing. Unlike Horovod's, they work without HOROVOD_TIMELINE=DYNAMIC."""

import os

from horovod_zero.torch.basics import _runtime


def start_timeline(file_path, mark_cycles=False):
    """Records the timeline into `file_path` (created, or emptied) from now on; a file
    being written is closed first, complete. Returns once recording has begun. With
    `mark_cycles`, the start of each negotiation cycle is marked (CYCLE_START).
    Starting again with the path in use only changes `mark_cycles`. Raises ValueError
    before hvd.init(), or when rank 0 cannot open the file."""
    path = os.fspath(file_path)
    if not path:
        raise ValueError("start_timeline needs a file path; call hvd.stop_timeline() to stop recording.")
    _runtime().set_timeline(path, bool(mark_cycles))


def stop_timeline():
    """Closes the timeline file, a complete JSON array; nothing more is recorded until
    the next start_timeline(). Without a timeline being written, does nothing."""
    _runtime().set_timeline("", False)
