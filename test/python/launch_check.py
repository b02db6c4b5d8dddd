"""Run by test_launch.py under each launcher: joins the job and allreduces rank + 1."""

import torch

import horovod_zero.torch as hvd
from horovod_zero.torch.basics import _world

hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="launch_check").item()
print(f"LAUNCH_OK rank={hvd.rank()} size={hvd.size()} launcher={_world().launcher} sum={total}", flush=True)
hvd.shutdown()
