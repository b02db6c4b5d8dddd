"""The state an elastic job keeps across resets, with Horovod's semantics:

- commit() saves the state (save()) and then checks for host changes;
- restore() goes back to the last commit: after a worker failed, the survivors' state
  may hold a step that not every rank took;
- sync() makes every rank's state rank 0's, for workers that joined;
- check_host_updates() raises HostsUpdatedInterrupt on every rank at once when the
  launcher reported added or removed hosts: rank 0's view of the notifications is
  broadcast, so all ranks see the same one at the same commit.
"""

import queue

from horovod_zero.torch.basics import rank
from horovod_zero.torch.objects import broadcast_object

# Horovod's HostUpdateResult flags, as the launcher's notifications carry them.
_REMOVED = 1


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by commit() or check_host_updates() on every rank when hosts were added or
    removed. hvd.elastic.run re-forms the job and calls the function again. skip_sync: only
    hosts were removed, so every remaining rank's state is already the same."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts were added or removed: the job re-forms at this commit")
        self.skip_sync = skip_sync


class State:
    """Base class of elastic state: subclasses define save(), restore() and sync()."""

    # Whether sync() must run after every reset, also one that only removed hosts (where
    # every remaining rank's state is already the same): a state that reset() rebuilds.
    sync_after_every_reset = False

    def __init__(self, bcast_object=broadcast_object, get_rank=rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages = queue.Queue()  # filled by the launcher's notification thread
        self._last_updated_timestamp = 0
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called after every reset (a worker lost or added), e.g. to scale the
        learning rate to the new hvd.size()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Called by the launcher's notification service (another thread)."""
        self._host_messages.put((timestamp, int(update_res)))

    def commit(self):
        """Saves the state in host memory, then raises HostsUpdatedInterrupt if hosts
        changed. Commits copy state, so commit every few batches rather than every one:
        a failure loses the batches since the last commit."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank when the launcher reported a change."""
        prev = last = self._last_updated_timestamp
        update = 0
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= res
        # Rank 0's view, so that every rank raises at the same commit.
        prev, self._last_updated_timestamp, update = self._bcast_object((prev, last, update))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(skip_sync=update == _REMOVED)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called after a reset, before sync(): re-make what depends on the job's size."""


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes:
    ObjectState(epoch=0, batch=0) has state.epoch and state.batch."""

    def __init__(self, bcast_object=broadcast_object, get_rank=rank, **kwargs):
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for k, v in self._saved_state.items():
            setattr(self, k, v)
