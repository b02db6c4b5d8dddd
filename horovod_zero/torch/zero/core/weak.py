"""Hooks that do not keep their object alive: the tensors and modules they are
registered on would otherwise hold the optimizer (its shards and state) for as
long as the model lives.

[Note: hooks and torch.compile]
Every hook made here runs eagerly, never traced by dynamo: it calls into the
runtime (enqueue, wait, free storage), which a graph cannot hold, and what it
reads (unit states, shard indices) changes from call to call, so a traced hook
would be recompiled per unit and per step. Inside a compiled module the hook is a
graph break: dynamo compiles the module's forward between its pre- and
post-forward hooks, as FSDP2 does with its own. A hook that only checks something
(check_hook) is skipped while dynamo traces, so that it costs no graph break
inside a compiled block."""

import weakref

import torch


def weak_hook(obj, method, *bound):
    """A hook that calls obj.<method>(*bound, *args) while obj lives, else does nothing."""
    ref = weakref.ref(obj)

    def hook(*args):
        target = ref()
        return None if target is None else getattr(target, method)(*bound, *args)
    return torch._dynamo.disable(hook, recursive=True, reason="horovod_zero hooks call into its runtime")


def check_hook(obj, method, *bound):
    """weak_hook for a check with no effect but raising: not run inside compiled code,
    where the eager hooks around the compiled module have done what it checks."""
    ref = weakref.ref(obj)

    def hook(*args):
        if torch.compiler.is_compiling():
            return None
        target = ref()
        return None if target is None else getattr(target, method)(*bound, *args)
    return hook
