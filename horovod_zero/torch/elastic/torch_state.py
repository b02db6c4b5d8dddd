"""TorchState: a model, an optimizer, ElasticSamplers and plain values as one elastic
state. A commit copies the model's and the optimizer's state_dict() to host memory;
restore() loads them back; sync() broadcasts rank 0's parameters, optimizer state and
sampler position, and the plain values, to every rank."""

import torch

from horovod_zero.torch.elastic.sampler import ElasticSampler
from horovod_zero.torch.elastic.state import ObjectState
from horovod_zero.torch.functions import broadcast_optimizer_state, broadcast_parameters
from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero import DistributedZeroOptimizer
from horovod_zero.torch.zero.state.dcp_state import staged  # a copy in host memory


class _Handler:
    def __init__(self, value):
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def save(self):
        self._saved = staged(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def save(self):
        self._saved = staged(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)  # torch moves the state to each parameter's device

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self):
        self._saved = dict(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))  # re-partitions for hvd.size()


def _handler(value):
    if isinstance(value, DistributedZeroOptimizer):
        raise ValueError(
            "TorchState does not keep a DistributedZeroOptimizer yet: its state is sharded, and a commit would have "
            "to keep every rank's shards where a lost rank cannot take them along. Until it does, restart from a "
            "sharded checkpoint: hvd.zero.save_checkpoint() every few steps, and hvd.zero.load_checkpoint() at the "
            "start (any number of ranks), under torchrun --nnodes=MIN:MAX (docs/launch.md).")
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """TorchState(model, optimizer, sampler=..., epoch=0, batch=0): each keyword becomes
    an attribute. Models, optimizers (torch.optim and hvd.DistributedOptimizer) and
    ElasticSamplers are kept through their state_dict(); other values as ObjectState
    keeps them. Assigning a new model or optimizer to the attribute commits it."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        for k in list(kwargs):
            h = _handler(kwargs[k])
            if h is not None:
                handlers[k] = h
                setattr(self, k, kwargs.pop(k))
        self._handlers = handlers
        super().__init__(**kwargs)

    def save(self):
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self):
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)
