"""Hooks that do not keep their object alive: the tensors and modules they are
registered on would otherwise hold the optimizer (its shards and state) for as
long as the model lives."""

import weakref


def weak_hook(obj, method, *bound):
    """A hook that calls obj.<method>(*bound, *args) while obj lives, else does nothing."""
    ref = weakref.ref(obj)

    def hook(*args):
        target = ref()
        return None if target is None else getattr(target, method)(*bound, *args)
    return hook
