"""Horovod's elastic API (`hvd.elastic`): training that goes on when workers fail or
hosts come and go. See docs/launch.md ("Elastic jobs")."""

from horovod_zero.torch.elastic.run import run
from horovod_zero.torch.elastic.sampler import ElasticSampler
from horovod_zero.torch.elastic.state import HostsUpdatedInterrupt, ObjectState, State
from horovod_zero.torch.elastic.torch_state import TorchState

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
