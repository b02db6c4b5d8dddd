"""A training script written for Horovod, as Horovod's documentation shows one
(docs/pytorch.rst: init, broadcast_parameters, broadcast_optimizer_state,
DistributedOptimizer), run unchanged by test_horovod_compat.py. Its `import horovod.torch`
is horovod_zero's API in the environment examples/setup.sh made."""

import sys

import torch
import horovod.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average)
for step in range(2):
    optimizer.zero_grad()
    model(torch.full((8, 4), float(hvd.rank() + step))).pow(2).mean().backward()
    optimizer.step()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total").item()
weights = ",".join(repr(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
sys.stdout.write(f"HOROVOD_SCRIPT rank={hvd.rank()} module={hvd.__name__} total={total} weights={weights}\n")
