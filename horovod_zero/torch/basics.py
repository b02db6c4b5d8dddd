"""The job's state (what init() starts and shutdown() stops) and the questions about
this process's place in the job. init() itself, which also registers process sets
(a collective step), is job.py's."""

import atexit
import os
import threading

import torch

from horovod_zero import settings as _settings
from horovod_zero.runner.elastic import take_next_slot
from horovod_zero.runner.rendezvous import make_gloo_backend, make_store, shm_control_name
from horovod_zero.runner.threads import rank_threads
from horovod_zero.runner.world import World, detect_world

from horovod_zero.native import core as _core
from horovod_zero.torch import peer_failure


class _State:
    """What init() creates: the world, the Gloo process group, the C++ runtime, and
    the settings read once from the environment then."""

    def __init__(self):
        self.lock = threading.Lock()
        self.world = None
        self.runtime = None
        self.backend = None
        self.store = None
        self.generation = 0
        self.exact_gradients = False  # HOROVOD_ZERO_EXACT_GRADIENTS, see autograd.py
        self.elastic = False  # HOROVOD_ELASTIC: horovodrun's elastic driver runs the job
        self.homogeneous = True  # every node runs the same number of ranks
        # What process sets' transports are built with (job.py), and the sets.
        self.shm_name = ""
        self.transport_timeout_seconds = 30.0
        self.gloo_iface = ""
        self.dynamic_process_sets = False  # HOROVOD_DYNAMIC_PROCESS_SETS, or init(process_sets="dynamic")
        self.process_sets = {}  # id -> ProcessSet, the global one included
        self.next_process_set_id = 1
        self.process_set_changes = 0  # names the checks of add/remove calls


_state = _State()

def _all_local_sizes_equal(backend, world: World) -> bool:
    """Whether every node runs as many ranks as this one: one small Gloo allgather,
    run before the runtime takes the process group over."""
    if world.size == 1:
        return True
    mine = torch.tensor([world.local_size], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world.size)]
    backend.allgather([every], [mine]).wait()
    return all(int(t) == world.local_size for t in every)


def _start(config):
    """The store, the job's Gloo group and the runtime, into _state."""
    if config.elastic and _state.generation > 0:
        # A re-init of an elastic job: this process's place in the job that forms now.
        # The driver gives up after the elastic timeout and says why: this process waits longer.
        take_next_slot(config.elastic_timeout_seconds + config.transport_timeout_seconds)
    world = detect_world()
    # Before the rendezvous: a bad entry fails this rank at once.
    thread_cpus = _settings.thread_cpus(config.thread_affinity, world.local_rank, world.local_size,
                                        os.sched_getaffinity(0))
    threads = rank_threads(world.local_size)  # None: OMP_NUM_THREADS chose, or one rank on the host
    if threads is not None:
        torch.set_num_threads(threads)
    timeout = config.transport_timeout_seconds
    # The elastic driver clears its rendezvous keys whenever it forms a job, and workers it
    # starts then begin at generation 0: every worker of the new job uses the same keys.
    store = make_store(world, 0 if config.elastic else _state.generation, timeout)
    backend = make_gloo_backend(store, world, timeout, config.gloo_iface)
    homogeneous = _all_local_sizes_equal(backend, world)
    shm_name = shm_control_name(store, world, config.shm_control)
    params = _settings.core_params(config, _core.Params())
    params.thread_cpus = thread_cpus
    runtime = _core.Runtime(
        backend, world.rank, world.size, world.local_rank, world.local_size, world.cross_rank, world.cross_size,
        shm_name, params,
    )
    _state.world, _state.store, _state.backend, _state.runtime = world, store, backend, runtime
    _state.exact_gradients, _state.homogeneous = config.exact_gradients, homogeneous
    _state.elastic = config.elastic
    _state.shm_name, _state.transport_timeout_seconds, _state.gloo_iface = shm_name, timeout, config.gloo_iface
    _state.generation += 1


def shutdown():
    """Stops the runtime on every rank; pending ops fail. init() may be called again."""
    with _state.lock:
        runtime = _state.runtime
        _state.runtime = None
    if runtime is not None:
        runtime.shutdown()
    # Sets belong to one init(): they must be passed to the next one again.
    for set_id, ps in _state.process_sets.items():
        if set_id != 0:
            ps.process_set_id = None
            ps._rank = None
    _state.process_sets = {}
    _state.backend = None
    _state.store = None


# atexit runs the last registered first: shutdown(), then the wait that lets a failed peer be
# reported first (peer_failure.py).
atexit.register(lambda: peer_failure.wait_at_exit(_state.elastic))
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


def _exact_gradients() -> bool:
    """HOROVOD_ZERO_EXACT_GRADIENTS as read by init()."""
    _runtime()
    return _state.exact_gradients


# --- what this build and job use (Horovod's query functions) ---------------------

def cuda_built() -> bool:
    """Whether the CUDA/NCCL path is usable in this process: built with CUDA, and a
    GPU visible. (Horovod's answers the build question alone; a CUDA build on a
    machine without GPUs says False here, since only CPU collectives run there.)"""
    return bool(_runtime().info()["cuda"])


def nccl_built() -> int:
    """As Horovod: NCCL's version code (e.g. 22105 for 2.21.5) when the NCCL path is
    usable (see cuda_built()), else 0. It is the NCCL that torch loads: the runtime
    links against that one."""
    if not cuda_built():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    # NCCL_VERSION_CODE's encoding changed at 2.9.
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def gloo_built() -> bool:
    """Always: CPU collectives and negotiation run over torch's Gloo."""
    return True


def gloo_enabled() -> bool:
    """Whether Gloo is in use now: from init() until shutdown()."""
    return is_initialized()


def mpi_built() -> bool:
    """Never: horovod_zero runs without MPI (mpirun only launches; see runner/)."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI to share threads with. (Horovod raises ValueError
    when MPI is not enabled; a False answer keeps scripts' non-MPI branch working.)"""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (compared once, at init())."""
    _runtime()
    return _state.homogeneous


def device() -> torch.device:
    """This local rank's CUDA device when CUDA is usable, else the CPU."""
    if torch.cuda.is_available() and cuda_built():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def runtime_info() -> dict:
    """The settings the runtime runs with (from HOROVOD_* variables) and counters."""
    return dict(_runtime().info())


def collective_stats(reset: bool = False) -> list:
    """Collectives executed so far: one dict per (process set id, op, device, wire
    dtype) with the number of collective calls, the tensors they carried and the
    buffer bytes ("process_set": 0 is the global set)."""
    rt = _runtime()
    stats = list(rt.stats())
    if reset:
        rt.reset_stats()
    return stats
