"""TorchState(..., commit_dir=path): commits go to disk instead of host memory, so that a
job whose workers all restart (torchrun --nnodes=MIN:MAX --max-restarts=N) goes on from
the last one, in any number of ranks.

Commit n writes each DistributedZeroOptimizer as a sharded checkpoint (DCP, every rank its
own shards) at <path>/zero.<name>.<n>, then the first rank writes <path>/state.pt: n, the
plain values, and the state_dict() of every other model, optimizer and sampler (the same on
every rank). state.pt is replaced in one rename, and it names the checkpoints that belong
to it, so a crash at any point leaves the previous commit whole; the checkpoints of commit
n - 1 are removed after. Loading reads state.pt on every rank, so <path> must be a file
system every rank sees."""

import os
import shutil

import torch

from horovod_zero.torch.basics import rank
from horovod_zero.torch.mpi_ops import barrier
from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero.state import checkpoint

STATE = "state.pt"


def _zero_path(root, name, number):
    return os.path.join(root, f"zero.{name}.{number}")


def last_number(root):
    """The number of the last complete commit in `root` (rank 0 reads, every rank gets it),
    or None."""
    number = None
    if rank() == 0 and os.path.exists(os.path.join(root, STATE)):
        number = torch.load(os.path.join(root, STATE), weights_only=False)["number"]
    return broadcast_object(number, name="elastic.disk.last")


def save(root, number, zero, plain, values):
    """Commit `number`. zero: {name: optimizer}; plain: {name: object with state_dict()}."""
    os.makedirs(root, exist_ok=True)
    for name, opt in zero.items():
        view = opt.sharded_state
        checkpoint.save_checkpoint(_zero_path(root, name, number), view.model, opt)
    if rank() == 0:
        tmp = os.path.join(root, STATE + ".saving")
        torch.save({"number": number, "values": values, "plain": {k: v.state_dict() for k, v in plain.items()}}, tmp)
        os.replace(tmp, os.path.join(root, STATE))
        for name in zero:
            old = _zero_path(root, name, number - 1)
            if os.path.isdir(old):
                shutil.rmtree(old)
    barrier()  # every rank returns once the commit is in place


def load(root, number, zero, plain):
    """Loads commit `number` into the optimizers and objects; returns the plain values."""
    for name, opt in zero.items():
        view = opt.sharded_state
        checkpoint.load_checkpoint(_zero_path(root, name, number), view.model, opt)
    saved = torch.load(os.path.join(root, STATE), weights_only=False)
    if saved["number"] != number:
        raise RuntimeError(f"{root} changed while it was loaded (commit {saved['number']}, expected {number}): is "
                           "another job committing there?")
    for k, v in plain.items():
        v.load_state_dict(saved["plain"][k])
    return saved["values"]
