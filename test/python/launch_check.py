"""Run by test_launch.py under each launcher: joins the job and allreduces rank + 1."""

import sys

import torch

import horovod_zero.torch as hvd
from horovod_zero.torch.basics import _world

hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="launch_check").item()
# One write per line: ranks share the launcher's stdout, and print() writes the newline separately.
sys.stdout.write(f"LAUNCH_OK rank={hvd.rank()} size={hvd.size()} launcher={_world().launcher} sum={total}\n")
sys.stdout.flush()
hvd.shutdown()
