"""`import horovod.torch as hvd` gives horovod_zero's API where Horovod's own cannot run.

Horovod's launcher package (horovod.runner, which our horovodrun drives) is installed without
Horovod's C++ extensions, which no longer build against current torch; its horovod.torch then
only prints "Extension horovod.torch has not been built" and offers no API. install() puts a
finder at the front of sys.meta_path that answers `horovod.torch` and every `horovod.torch.X`
with horovod_zero.torch's own module objects (the same objects, so there is one runtime), and
Horovod scripts run unchanged. The rest of Horovod (horovod.runner, horovod.common) stays
Horovod's, and where Horovod's torch extension was built the finder steps aside.

A .pth file in the environment's site-packages calls install() when Python starts; it is
written by `python -m horovod_zero.horovod_compat install` (__main__.py), which
examples/setup.sh runs. Only the standard library is imported here: the .pth runs in every
interpreter of the environment, and torch is loaded only when horovod.torch is imported.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HOROVOD_TORCH = "horovod.torch"
_OURS = "horovod_zero.torch"
# Horovod's torch extension, whose absence horovod.torch reports (horovod/common/util.py: check_extension).
_HOROVOD_EXTENSION = "mpi_lib_v2"
PTH_NAME = "horovod_zero_horovod_torch.pth"  # sorts after setup.sh's horovod_zero_checkout.pth, which it needs
# One line, as .pth files require; a checkout deleted later leaves no error at every start.
PTH_LINE = ("import importlib.util as u; u.find_spec('horovod_zero') and "
            "__import__('horovod_zero.horovod_compat').horovod_compat.install()\n")


def _horovod_extension_built(path) -> bool:
    """Whether the horovod.torch found on `path` (the horovod package's) has its extension."""
    spec = importlib.machinery.PathFinder.find_spec(_HOROVOD_TORCH, path)
    folders = (spec.submodule_search_locations or []) if spec else []
    return any(os.path.exists(os.path.join(folder, _HOROVOD_EXTENSION + suffix))
               for folder in folders for suffix in importlib.machinery.EXTENSION_SUFFIXES)


class _Alias(importlib.abc.Loader):
    """Loads a name as an existing module of ours: the module object itself, not a copy."""

    def __init__(self, target: str):
        self._target = target
        self._spec = None

    def create_module(self, spec):
        # The import by name is this loader's whole job (not a hidden import cycle).
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec  # importing under the alias pointed it at the alias's spec


class _HorovodTorchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _HOROVOD_TORCH and not name.startswith(_HOROVOD_TORCH + "."):
            return None
        if name == _HOROVOD_TORCH and _horovod_extension_built(path):
            return None  # Horovod's own works: leave it to the usual finders
        if name != _HOROVOD_TORCH and sys.modules.get(_HOROVOD_TORCH) is not sys.modules.get(_OURS):
            return None  # a submodule of Horovod's own horovod.torch
        ours = _OURS + name[len(_HOROVOD_TORCH):]
        spec = importlib.util.find_spec(ours)
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {name!r}: in this environment horovod.torch is horovod_zero's API "
                f"(horovod_zero.torch), which has no {ours!r}. See horovod_zero's README for what it provides.",
                name=name)
        return importlib.util.spec_from_loader(name, _Alias(ours), is_package=spec.submodule_search_locations
                                               is not None)


def install() -> None:
    """Makes `import horovod.torch` horovod_zero's in this process (idempotent)."""
    if not any(isinstance(f, _HorovodTorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HorovodTorchFinder())
