"""Sharded checkpoints in torch.distributed.checkpoint's format: every rank writes its
own shards, in parallel, and reads back the chunks its own shards need, so a
checkpoint loads into any world size, stage, sharding and offload.

A save writes into <path>.saving and moves it to <path> only once complete (every
rank's files synced, then the metadata), so a crash during a save leaves the
previous checkpoint at <path> as it was. Replacing it takes two renames; if a crash
falls between them, the previous checkpoint is at <path>.old, and a load of <path>
says so."""

import os
import shutil
import threading

from horovod_zero.torch.zero.state import dcp_io, dcp_state

SAVING, OLD = ".saving", ".old"


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(path):
    """Puts the complete <path>.saving in place of <path> (first rank only)."""
    old = path + OLD
    _remove(old)
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(path + SAVING, path)
    dcp_io.fsync_dir(os.path.dirname(os.path.abspath(path)))
    _remove(old)


def _clear_staging(path, scope, tag):
    """The first rank empties <path>.saving (a failed save's leftovers) before any rank writes there."""
    failure = None
    if scope.is_root():
        try:
            _remove(path + SAVING)
            os.makedirs(path + SAVING)
        except Exception as e:  # every rank must hear of it
            failure = e
    dcp_io.announce(scope, f"{tag}.staging", failure, f"Preparing {path + SAVING!r} for the checkpoint failed")


class CheckpointSave:
    """A checkpoint being written in the background (hvd.zero.async_save_checkpoint).

    done(): whether this rank's files are written. wait(): blocks until the whole
    checkpoint is in place; every rank must call it (the last step is collective),
    and the next save or load of the same optimizer calls it first."""

    def __init__(self, planned, path, on_finish):
        self._planned, self.path, self._on_finish = planned, path, on_finish
        self._thread = threading.Thread(target=planned.write, name="hvd-zero-checkpoint", daemon=True)
        self._thread.start()
        self._finished = False

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        if self._finished:
            return
        self._thread.join()
        self._finished = True
        self._on_finish()
        _finish(self._planned, self.path)


def _finish(planned, path):
    planned.finish()
    failure, scope = None, planned.scope
    if scope.is_root():
        try:
            _commit(path)
        except Exception as e:  # every rank must hear of it
            failure = e
    dcp_io.announce(scope, f"{planned.tag}.commit", failure, f"Moving the finished checkpoint to {path!r} failed")


def _settle(view):
    """Finishes this optimizer's save still in flight, if any (collective, as every rank has one)."""
    pending = view.pending_save
    if pending is not None:
        pending.wait()


def save(path, model, opt, blocking=True):
    view = opt.sharded_state
    _settle(view)
    path = os.fspath(path)
    tag = "zero.dcp.save"
    _clear_staging(path, view.scope, tag)
    with view.materialized():
        state = dcp_state.save_state(model, view)
        if not blocking:
            state = dcp_state.staged(state)
        planned = dcp_io.PlannedSave(state, path + SAVING, view.scope, tag)
        if blocking:
            planned.write()
    if blocking:
        _finish(planned, path)
        return None

    def forget():
        view.pending_save = None

    handle = CheckpointSave(planned, path, forget)
    view.pending_save = handle
    return handle


def load(path, model, opt):
    view = opt.sharded_state
    _settle(view)
    path = os.fspath(path)
    tag = "zero.dcp.load"
    metadata = dcp_io.read_metadata(path, view.scope, tag)
    with view.materialized(write_back=True):
        target = dcp_state.LoadTarget(model, view, metadata)  # refuses a misfit alike on every rank
        objects = target.objects()
        dcp_io.read(objects, path, metadata, view.scope, f"{tag}.objects")
        target.take(objects)
        target.check()  # before any tensor is read: a refused load leaves the model as it was
        dcp_io.read(target.tensors(), path, metadata, view.scope, tag)
        target.apply()
        view.publish()


def kind(path):
    """What is at `path`: "dcp", "file" (a consolidated checkpoint), or why it cannot be loaded."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, dcp_io.METADATA)):
            return "dcp"
        return (f"{path!r} is a directory without {dcp_io.METADATA}: no complete checkpoint (a save that did not "
                "finish, or not a checkpoint)")
    if os.path.isfile(path):
        return "file"
    if os.path.isdir(path + OLD):
        return (f"there is no checkpoint at {path!r}: a save that was replacing it stopped between its two renames. "
                f"The previous checkpoint is complete at {path + OLD!r}; load that, or move it to {path!r}")
    return f"there is no checkpoint at {path!r}"
