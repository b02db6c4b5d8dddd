"""Run by test_who_failed_first.py under each launcher: rank 1 fails with exit code 3 while
rank 0 waits on it in a collective. Rank 1's exit takes a moment after the others heard of it
(2 s here; a real rank's teardown of the interpreter, CUDA and NCCL can take as long), so a
rank 0 that exited at once would be the first to exit, every time."""

import sys
import time

import torch

import horovod_zero.torch as hvd

hvd.init()
hvd.allreduce(torch.ones(1), name="together")
if hvd.rank() == 1:
    hvd.shutdown()  # what exiting does first: the other ranks hear of it at once
    time.sleep(2)  # the rest of the exit
    sys.exit(3)
hvd.allreduce(torch.ones(1), name="never")  # rank 1 never submits it: rank 0 raises here
