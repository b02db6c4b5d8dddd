"""init/shutdown and the questions about this process's place in the job."""

import atexit
import os
import threading

import torch

from horovod_zero.runner.rendezvous import make_gloo_backend, make_store, shm_control_name
from horovod_zero.runner.world import World, detect_world

try:
    from horovod_zero import _core
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "horovod_zero's C++ extension is not built. Run `pip install -e .` (or examples/setup.sh) first."
    ) from e


class _State:
    """What init() creates: the world, the Gloo process group, the C++ runtime."""

    def __init__(self):
        self.lock = threading.Lock()
        self.world = None
        self.runtime = None
        self.backend = None
        self.store = None
        self.generation = 0


_state = _State()


def _timeout_s():
    return float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30") or 30)


def init():
    """Joins the job described by the launcher's environment (horovodrun, torchrun,
    or none: size 1) and starts the background runtime. Calling it again while
    initialized does nothing."""
    with _state.lock:
        if _state.runtime is not None:
            return
        world = detect_world()
        timeout = _timeout_s()
        store = make_store(world, _state.generation, timeout)
        backend = make_gloo_backend(store, world, timeout)
        runtime = _core.Runtime(
            backend, world.rank, world.size, world.local_rank, world.local_size, world.cross_rank, world.cross_size,
            shm_control_name(store, world),
        )
        _state.world, _state.store, _state.backend, _state.runtime = world, store, backend, runtime
        _state.generation += 1


def shutdown():
    """Stops the runtime on every rank; pending ops fail. init() may be called again."""
    with _state.lock:
        runtime = _state.runtime
        _state.runtime = None
    if runtime is not None:
        runtime.shutdown()
    _state.backend = None
    _state.store = None


atexit.register(shutdown)


def is_initialized() -> bool:
    return _state.runtime is not None


def _runtime():
    rt = _state.runtime
    if rt is None:
        raise ValueError("horovod_zero has not been initialized; call hvd.init() first.")
    return rt


def _world() -> World:
    _runtime()
    return _state.world


def rank() -> int:
    return _world().rank


def size() -> int:
    return _world().size


def local_rank() -> int:
    return _world().local_rank


def local_size() -> int:
    return _world().local_size


def cross_rank() -> int:
    return _world().cross_rank


def cross_size() -> int:
    return _world().cross_size


def cuda_built() -> bool:
    """Whether the CUDA/NCCL path is usable in this process (built, and a GPU visible)."""
    return bool(_runtime().info()["cuda"])


def nccl_built() -> bool:
    return cuda_built()


def gloo_built() -> bool:
    return True


def device() -> torch.device:
    """This local rank's CUDA device when CUDA is usable, else the CPU."""
    if torch.cuda.is_available() and cuda_built():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def runtime_info() -> dict:
    """The settings the runtime runs with (from HOROVOD_* variables) and counters."""
    return dict(_runtime().info())


def collective_stats(reset: bool = False) -> list:
    """Collectives executed so far: one dict per (op, device, wire dtype) with the
    number of collective calls, the tensors they carried and the buffer bytes."""
    rt = _runtime()
    stats = list(rt.stats())
    if reset:
        rt.reset_stats()
    return stats
