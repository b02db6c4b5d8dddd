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
import uuid

from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero.state import dcp_io, dcp_state

SAVING, OLD = ".saving", ".old"
MARK = ".hvd_zero_staging"  # the first rank's mark in <path>.saving (_clear_staging)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(path):
    """Puts the complete <path>.saving in place of <path> (first rank only)."""
    dcp_io.fsync_dir(path + SAVING)  # its .metadata is in it for good before the previous one goes
    old = path + OLD
    _remove(old)
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(path + SAVING, path)
    dcp_io.fsync_dir(os.path.dirname(os.path.abspath(path)))
    _remove(old)


def _clear_staging(path, scope, tag):
    """The first rank empties <path>.saving (a failed save's leftovers) before any rank
    writes there, and leaves a mark in it that every rank then looks for: a rank that
    does not see it writes to another filesystem, where its shards would be lost."""
    failure, mark = None, None
    if scope.is_root():
        try:
            _remove(path + SAVING)
            os.makedirs(path + SAVING)
            mark = uuid.uuid4().hex
            with open(os.path.join(path + SAVING, MARK), "w") as f:
                f.write(mark)
        except Exception as e:  # every rank must hear of it
            failure = e
    dcp_io.announce(scope, f"{tag}.staging", failure, f"Preparing {path + SAVING!r} for the checkpoint failed")
    return broadcast_object(mark, root_rank=scope.root, name=f"{tag}.mark", process_set=scope.process_set)


def _check_mark(path, mark):
    try:
        with open(os.path.join(path + SAVING, MARK)) as f:
            seen = f.read()
    except OSError:
        seen = None
    if seen != mark:
        raise RuntimeError(f"{path + SAVING!r} is not the directory the first rank made: the checkpoint must be on a "
                           "filesystem every rank shares")


class CheckpointSave:
    """A checkpoint being written in the background (hvd.zero.async_save_checkpoint).

    done(): whether this rank's own files are written; it differs between ranks, so
    do not decide on it whether to call wait(). wait(): blocks until the whole
    checkpoint is in place; every rank must call it (the last step is collective), and
    the next save or load of the same optimizer calls it first. A failed save raises
    from every wait()."""

    def __init__(self, planned, path, on_finish):
        self._planned, self.path, self._on_finish = planned, path, on_finish
        self._thread = threading.Thread(target=planned.write, name="hvd-zero-checkpoint", daemon=True)
        self._thread.start()
        self._outcome = None  # after wait(): None (in place) or the exception

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        if self._planned is not None:
            self._thread.join()
            planned, self._planned = self._planned, None  # the staged copy goes with it
            self._on_finish()
            try:
                _finish(planned, self.path)
            except Exception as e:  # every rank raises it, now and at every later wait()
                self._outcome = e
        if self._outcome is not None:
            raise self._outcome


def _finish(planned, path):
    planned.finish()
    failure, scope = None, planned.scope
    if scope.is_root():
        try:
            _commit(path)
        except Exception as e:  # every rank must hear of it
            failure = e
    dcp_io.announce(scope, f"{planned.tag}.commit", failure, f"Moving the finished checkpoint to {path!r} failed")


def settle(view):
    """Finishes this optimizer's save still in flight, if any (collective, as every rank has one)."""
    pending = view.pending_save
    if pending is not None:
        pending.wait()


def save(path, model, opt, blocking=True):
    view = opt.sharded_state
    settle(view)
    path = os.fspath(path)
    tag = "zero.dcp.save"
    mark = _clear_staging(path, view.scope, tag)

    def state():  # inside the plan's exchange: a rank that fails here makes every rank raise
        _check_mark(path, mark)
        made = dcp_state.save_state(model, view)
        return made if blocking else dcp_state.staged(made)

    with view.materialized():
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
    settle(view)
    path = os.fspath(path)
    tag = "zero.dcp.load"
    metadata = dcp_io.read_metadata(path, view.scope, tag)
    with view.materialized(write_back=True):
        target, failure = None, None
        try:
            target = dcp_state.LoadTarget(model, view, metadata)  # refuses a misfit alike on every rank
        except ValueError:
            raise  # the same on every rank: the same metadata, the same model
        except Exception as e:  # this rank alone (out of memory): every rank must hear of it
            failure = e
        dcp_io.exchange(view.scope, f"{tag}.target", failure=failure, what="Preparing the load")
        objects = target.objects()
        dcp_io.read(objects, path, metadata, view.scope, f"{tag}.objects")
        target.take(objects)
        target.check()  # before any tensor is read: a refused load leaves the model as it was
        dcp_io.read(target.tensors(), path, metadata, view.scope, tag)
        failure = None
        try:
            target.apply()
        except Exception as e:  # every rank must hear of it before the collective publish
            failure = e
        dcp_io.exchange(view.scope, f"{tag}.applied", failure=failure, what="Loading the optimizer state")
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
