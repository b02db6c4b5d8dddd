"""The C++ extension, horovod_zero._core, as `core`: loaded only under the torch it was built against.

The extension is compiled against one torch release's C++ API. Under another torch (say,
`pip install torchvision` upgraded it) it fails to load with an undefined symbol, or loads
and misbehaves. The build records the torch version beside the module (_build_info.py,
written by python/CMakeLists.txt); this module compares it with the torch imported here
before loading, and every failure says which command rebuilds.
"""

import importlib
import os

import torch

_CHECKOUT_SETUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "setup.sh")


def rebuild_command():
    """What rebuilds this copy: the setup script for a checkout built in place, pip for an
    installed wheel."""
    if os.path.isfile(_CHECKOUT_SETUP):
        return f"bash {_CHECKOUT_SETUP}"
    return "pip install --no-build-isolation --force-reinstall --no-deps . (in horovod_zero's source directory)"


def check_torch_version(built_with, found):
    """Raises ImportError when the extension was built against another torch than `found`."""
    if built_with != found:
        raise ImportError(
            f"horovod_zero's C++ extension was built against torch {built_with}, but torch {found} is "
            f"installed now. Rebuild it against this torch: {rebuild_command()}"
        )


def _load():
    try:
        build_info = importlib.import_module("horovod_zero._build_info")
    except ModuleNotFoundError:
        build_info = None  # not built, or built before the version was recorded
    if build_info is not None:
        check_torch_version(build_info.TORCH_VERSION, torch.__version__)
    try:
        return importlib.import_module("horovod_zero._core")
    except ModuleNotFoundError as e:
        if e.name != "horovod_zero._core":
            raise
        raise ImportError(f"horovod_zero's C++ extension is not built. Build it: {rebuild_command()}") from e
    except ImportError as e:
        raise ImportError(f"horovod_zero's C++ extension failed to load ({e}). Rebuild it: {rebuild_command()}") from e


core = _load()
