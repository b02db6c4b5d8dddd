"""hvd.zero.save_checkpoint / async_save_checkpoint / load_checkpoint: sharded
checkpoints in DCP's format (sharded_checkpoint.py) by default; the consolidated
single file through rank 0 (consolidated.py) on request. A load reads either, from a
job of any size."""

import os

from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero.state import consolidated, sharded_checkpoint

FORMATS = ("dcp", "consolidated")


def save_checkpoint(path, model, opt, format="dcp"):
    """Saves the model and optimizer state: format="dcp" (a directory every rank
    writes its shards into, in torch.distributed.checkpoint's layout, which FSDP2
    reads) or "consolidated" (one file, written by the first rank). Every rank calls it."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: use one of {FORMATS}")
    sharded_checkpoint.settle(opt.sharded_state)  # an async save still writing lands first
    if format == "consolidated":
        return consolidated.save_file(path, model, opt)
    return sharded_checkpoint.save(path, model, opt)


def async_save_checkpoint(path, model, opt):
    """Starts a DCP save and returns once this rank's state is copied to host memory;
    the files are written in the background. Returns a handle: done() tells whether
    this rank's files are written, wait() (every rank) whether the checkpoint is in
    place, raising if any rank failed. The next save or load waits for it first."""
    return sharded_checkpoint.save(path, model, opt, blocking=False)


def load_checkpoint(path, model, opt):
    """Loads a checkpoint of either format, saved by a job of any size, stage and
    sharding, or a DCP checkpoint FSDP2 wrote ({"model": ..., "optim": ...} of
    get_state_dict). Every rank calls it."""
    path = os.fspath(path)
    sharded_checkpoint.settle(opt.sharded_state)  # an async save still writing (perhaps to `path`) lands first
    scope = opt.sharded_state.scope
    found = broadcast_object(sharded_checkpoint.kind(path) if scope.is_root() else None, root_rank=scope.root,
                             name="zero.ckpt.kind", process_set=scope.process_set)
    if found == "dcp":
        return sharded_checkpoint.load(path, model, opt)
    if found == "file":
        return consolidated.load_file(path, model, opt)
    raise FileNotFoundError(f"No rank loads the checkpoint: {found}")
