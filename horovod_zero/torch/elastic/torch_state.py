"""TorchState: a model, an optimizer, ElasticSamplers and plain values as one elastic
state. A commit copies the model's and the optimizer's state_dict() to host memory;
restore() loads them back; sync() broadcasts rank 0's parameters, optimizer state and
sampler position, and the plain values, to every rank. A DistributedZeroOptimizer's state
is sharded: its commits keep each rank's shards and a copy of them on another rank, and a
job of another size reshards them (zero/state/replicas.py)."""

import os

import torch

from horovod_zero.torch.elastic import disk
from horovod_zero.torch.elastic.sampler import ElasticSampler
from horovod_zero.torch.elastic.state import ObjectState
from horovod_zero.torch.functions import broadcast_optimizer_state, broadcast_parameters
from horovod_zero.torch.objects import broadcast_object
from horovod_zero.torch.zero import DistributedZeroOptimizer
from horovod_zero.torch.zero.state import replicas
from horovod_zero.torch.zero.state.dcp_state import staged  # a copy in host memory


class _Handler:
    """A model, an optimizer or an ElasticSampler: a commit is a host copy of its
    state_dict(); restore() loads it back; sync() gives every rank rank 0's (`broadcast`)."""

    def __init__(self, value, broadcast):
        self.value = value
        self._broadcast = broadcast
        self.save()

    def save(self):
        self._saved = staged(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)  # torch moves an optimizer's state to its parameters' devices

    def sync(self):
        self._broadcast(self.value)


def _broadcast_model(model):
    broadcast_parameters(model.state_dict(), root_rank=0)


def _broadcast_optimizer(opt):
    broadcast_optimizer_state(opt, root_rank=0)


def _broadcast_sampler(sampler):
    sampler.load_state_dict(broadcast_object(sampler.state_dict()))  # re-partitions for hvd.size()


class _ZeroHandler:
    """A DistributedZeroOptimizer, and its model: a commit keeps this rank's shards and a copy
    of another rank's (zero/state/replicas.py). After a reset the optimizer is sharded for
    the new job (reset()), and sync() loads the commit into it, or, at the job's start,
    takes the first one."""

    def __init__(self, value):
        self.value = value
        self._commit = None
        self._number = 0  # commits so far: names each commit's collectives alike on every rank

    def save(self):
        view = self.value.sharded_state
        commit = replicas.take(view, view.model, self._number + 1)
        self._commit, self._number = commit, commit.number  # the last one is kept until this one is whole

    def restore(self):
        pass  # the reset that follows shards the optimizer for the new job, and sync() loads the commit

    def reset(self):
        self.value._rejoin()

    def sync(self):
        view = self.value.sharded_state
        number = replicas.restore(self._commit, view, view.model)
        if number is None:
            self.save()
        else:
            self._number = number


class _Covered:
    """A model whose state a DistributedZeroOptimizer's commits keep."""

    def __init__(self, value):
        self.value = value

    def save(self):
        pass

    restore = sync = save


def _handler(value, zero_models):
    if isinstance(value, DistributedZeroOptimizer):
        if value.sharded_state.scope.process_set is not None:
            raise ValueError("TorchState keeps a DistributedZeroOptimizer over every rank of the job; this one spans "
                             "a process set (process_set=), whose ranks a reset renumbers. Build it without "
                             "process_set=, or with shard_group='node' for sharding inside each node.")
        return _ZeroHandler(value)
    if isinstance(value, torch.nn.Module):
        return _Covered(value) if id(value) in zero_models else _Handler(value, _broadcast_model)
    if isinstance(value, torch.optim.Optimizer):
        return _Handler(value, _broadcast_optimizer)
    if isinstance(value, ElasticSampler):
        return _Handler(value, _broadcast_sampler)
    return None


class TorchState(ObjectState):
    """TorchState(model, optimizer, sampler=..., epoch=0, batch=0): each keyword becomes
    an attribute. Models, optimizers (torch.optim and hvd.DistributedOptimizer) and
    ElasticSamplers are kept through their state_dict(); other values as ObjectState
    keeps them. Assigning a new model or optimizer to the attribute commits it.
    commit_dir=path: commits go to files there instead of host memory (elastic/disk.py),
    and sync() starts from the last one: for launchers that restart every worker."""

    def __init__(self, model=None, optimizer=None, commit_dir=None, **kwargs):
        self._commit_dir = os.fspath(commit_dir) if commit_dir is not None else None
        self._disk_number = 0  # the last commit in commit_dir
        kwargs.update(model=model, optimizer=optimizer)
        zero_models = {id(v.sharded_state.model) for v in kwargs.values() if isinstance(v, DistributedZeroOptimizer)}
        handlers = {}
        for k in list(kwargs):
            h = _handler(kwargs[k], zero_models)
            if h is not None:
                handlers[k] = h
                setattr(self, k, kwargs.pop(k))
        # ZeRO commits first: they are collective and may fail, and then nothing else may have
        # been saved yet, so that the last commit stays whole.
        self._handlers = dict(sorted(handlers.items(), key=lambda kv: not isinstance(kv[1], _ZeroHandler)))
        super().__init__(**kwargs)

    def save(self):
        if self._commit_dir is not None:
            super().save()
            self._disk_number += 1
            disk.save(self._commit_dir, self._disk_number, *self._by_kind(), self._saved_state)
            return
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        if self._commit_dir is None:  # else sync() reads the last commit from disk
            for h in self._handlers.values():
                h.restore()
        super().restore()

    def sync(self):
        if self._commit_dir is not None:
            number = disk.last_number(self._commit_dir)
            if number is None:
                self.save()  # the job's first start: commit 1 is where it starts
                return
            self._disk_number = number
            self._saved_state = disk.load(self._commit_dir, number, *self._by_kind())  # ZeRO's load publishes
            self._set_attrs()
            return
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def _by_kind(self):
        """({name: ZeRO optimizer}, {name: other object kept through state_dict()})."""
        zero = {k: h.value for k, h in self._handlers.items() if isinstance(h, _ZeroHandler)}
        plain = {k: h.value for k, h in self._handlers.items() if not isinstance(h, (_ZeroHandler, _Covered))}
        return zero, plain

    def reset(self):
        for h in self._handlers.values():
            if hasattr(h, "reset"):
                h.reset()

    @property
    def sync_after_every_reset(self):
        """A ZeRO optimizer is sharded anew at each reset, and only sync() loads its state."""
        return any(isinstance(h, _ZeroHandler) for h in self.__dict__.get("_handlers", {}).values())

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)
