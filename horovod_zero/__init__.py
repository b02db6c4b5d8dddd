"""horovod_zero: Horovod-style collectives and ZeRO sharded data parallelism for PyTorch.

Import the PyTorch API as ``import horovod_zero.torch as hvd``.
"""

__version__ = "0.1.0"
