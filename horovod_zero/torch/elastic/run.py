"""hvd.elastic.run: calls the training function until it returns, re-forming the job
after a failure (HorovodInternalError: the last commit is restored first) or a host
change (HostsUpdatedInterrupt). A reset is hvd.shutdown() and hvd.init(): under
horovodrun's elastic driver, init() then takes this worker's place in the new job
(runner/elastic.py); the state is then synced from the new rank 0."""

import functools

from horovod_zero.torch import basics
from horovod_zero.torch.elastic.state import HostsUpdatedInterrupt
from horovod_zero.torch.enqueue import HorovodInternalError
from horovod_zero.torch.job import init

try:  # horovodrun's elastic driver tells rank 0 of host changes through this service
    from horovod.common.elastic import notification_manager as _notifications
except ImportError:  # the launcher is not installed: no driver to hear from
    _notifications = None


def _reset():
    basics.shutdown()
    init()


def _listening():
    """Whether horovodrun's elastic driver runs this job (it sets HOROVOD_ELASTIC=1)."""
    basics._runtime()  # refuses a call before hvd.init()
    return _notifications is not None and basics._state.elastic


def run(func):
    """Decorates `func(state, *args, **kwargs)`, the training loop: the decorated function
    syncs the state from rank 0, calls func, and on a failure or a host change re-forms
    the job, calls the state's reset callbacks and calls func again."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        listening = _listening()
        if listening:
            _notifications.init()
            _notifications.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()  # undo what the failed step changed on this rank
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync and not state.sync_after_every_reset
                _reset()
                state.on_reset()
        finally:
            if listening:
                _notifications.remove_listener(state)
    return wrapper
