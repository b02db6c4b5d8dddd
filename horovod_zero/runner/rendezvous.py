"""The key-value store every rank meets on, and the Gloo process group built on it.

- torchrun: the TCPStore at MASTER_ADDR:MASTER_PORT.
- horovodrun: rank 0 starts a TCPStore and publishes its address through
  horovodrun's HTTP rendezvous server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT), under a
  scope of our own; the other ranks read it there.
- srun: a TCPStore on the first host of the step's node list, at MASTER_PORT or a
  port derived from the job and step ids (every task derives the same one).
- mpirun: a TCPStore at MASTER_ADDR:MASTER_PORT when the user exports them
  (`mpirun -x MASTER_ADDR -x MASTER_PORT`); on one host without them, a FileStore
  named after Open MPI's job id, so no port has to be agreed.
- size 1: an in-process HashStore.
"""

import datetime
import os
import socket
import tempfile
import time
import uuid
import urllib.error
import urllib.request

import torch.distributed as dist

from horovod_zero.runner.world import World

SCOPE = "horovod_zero"


def _http_put(addr, port, key, value: bytes, timeout):
    req = urllib.request.Request(f"http://{addr}:{port}/{SCOPE}/{key}", data=value, method="PUT")
    urllib.request.urlopen(req, timeout=timeout).read()


def _http_get(addr, port, key, timeout):
    """Polls until the key exists (the server answers 404 before that)."""
    deadline = time.monotonic() + timeout
    url = f"http://{addr}:{port}/{SCOPE}/{key}"
    while True:
        try:
            return urllib.request.urlopen(url, timeout=timeout).read()
        except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Rank 0 did not publish '{key}' on the horovodrun rendezvous server "
                    f"{addr}:{port} within {timeout:.0f} s ({e}). Is rank 0 running?"
                ) from None
            time.sleep(0.05)


def _horovodrun_store(world: World, generation: int, timeout: datetime.timedelta):
    env = os.environ
    addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        raise RuntimeError(
            "HOROVOD_RANK is set but HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT are not: launch with "
            "`python -m horovod_zero.runner` (gloo mode), or with torchrun."
        )
    key = f"store_{generation}"
    if world.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, world.size, True, timeout=timeout, wait_for_workers=False)
        host = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
        _http_put(addr, port, key, f"{host}:{store.port}".encode(), timeout.total_seconds())
        return store
    host, store_port = _http_get(addr, port, key, timeout.total_seconds()).decode().rsplit(":", 1)
    return dist.TCPStore(host, int(store_port), world.size, False, timeout=timeout)


def _torchrun_store(world: World, timeout: datetime.timedelta):
    env = os.environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; launch with torchrun.")
    # Under torchrun the agent already serves the store; otherwise rank 0 does.
    is_master = world.rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return dist.TCPStore(addr, int(port), world.size, is_master, timeout=timeout)


def slurm_first_host(nodelist: str) -> str:
    """The first host of Slurm's compressed node list: "gpu[03-05,9],cpu1" -> "gpu03"."""
    head = ""
    rest = nodelist.strip()
    while rest and rest[0] != ",":
        if rest[0] == "[":
            inside, _, rest = rest[1:].partition("]")
            head += inside.split(",")[0].split("-")[0]
        else:
            head += rest[0]
            rest = rest[1:]
    return head


def _tcp_store(world: World, addr: str, port: int, timeout: datetime.timedelta, hint: str):
    try:
        return dist.TCPStore(addr, port, world.size, world.rank == 0, timeout=timeout)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(
            f"Rank {world.rank} of {world.size} ({world.launcher}) could not meet the other ranks at "
            f"{addr}:{port} within {timeout.total_seconds():.0f} s: {str(e).splitlines()[0]}. {hint}"
        ) from None


def slurm_port(env) -> int:
    """MASTER_PORT, else a port in [20000, 40000) that every task of a job step derives alike."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    step = int(env.get("SLURM_JOB_ID", "0") or 0) * 97 + int(env.get("SLURM_STEP_ID", "0") or 0)
    return 20000 + step % 20000


def _srun_store(world: World, timeout: datetime.timedelta):
    env = os.environ
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (slurm_first_host(nodes) if nodes else "")
    if not addr:
        raise RuntimeError("srun set SLURM_PROCID but no node list (SLURM_JOB_NODELIST); set MASTER_ADDR to the host of rank 0.")
    return _tcp_store(
        world, addr, slurm_port(env), timeout,
        "Start every task with srun (a plain `python` inside an sbatch script is one task of "
        f"SLURM_NTASKS={world.size}), or set MASTER_PORT to a free port.",
    )


def _mpirun_store(world: World, generation: int, timeout: datetime.timedelta):
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return _tcp_store(world, env["MASTER_ADDR"], int(env["MASTER_PORT"]), timeout,
                          "MASTER_ADDR must be the host of rank 0 and MASTER_PORT a free port there.")
    if world.local_size != world.size:
        raise RuntimeError(
            "mpirun across hosts needs the address of rank 0's host: run "
            "`mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...`."
        )
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    if not job:
        raise RuntimeError("mpirun set no job id (OMPI_MCA_ess_base_jobid); set MASTER_ADDR and MASTER_PORT.")
    path = os.path.join(tempfile.gettempdir(), f"horovod_zero-{os.getuid()}-mpirun-{job}-{generation}.store")
    return dist.FileStore(path, world.size)


def make_store(world: World, generation: int, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if world.size == 1:
        return dist.HashStore()
    if world.launcher == "horovodrun":
        store = _horovodrun_store(world, generation, timeout)
    elif world.launcher == "srun":
        store = _srun_store(world, timeout)
    elif world.launcher == "mpirun":
        store = _mpirun_store(world, generation, timeout)
    else:
        store = _torchrun_store(world, timeout)
    # A prefix per init() generation keeps a re-init (and the user's own
    # torch.distributed use of the same store) from reading stale keys. torchrun's agent
    # keeps its store when it restarts the workers (--max-restarts): a prefix per restart too.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if world.launcher == "torchrun" else "0"
    return dist.PrefixStore(f"{SCOPE}/{restart}.{generation}", store)


def make_gloo_backend(store, world: World, timeout_s: float, iface: str = ""):
    """`iface`: the network interface Gloo uses (HOROVOD_GLOO_IFACE); "": the default."""
    return make_group_backend(store, world.rank, world.size, timeout_s, iface)


def make_group_backend(store, rank: int, size: int, timeout_s: float, iface: str = ""):
    """A Gloo group of `size` processes meeting on `store`, this one as `rank`: the
    job's (make_gloo_backend), or a process set's (a store prefixed for the set)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if iface:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def shm_control_name(store, world: World, enabled: bool = True) -> str:
    """The shared-memory segment ranks negotiate through when they all share this
    host and `enabled` (HOROVOD_ZERO_SHM_CONTROL); "" means negotiate over Gloo."""
    if world.size == 1 or world.local_size != world.size or not enabled:
        return ""
    if world.rank == 0:
        store.set("shm_control", f"/hvdz_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    return store.get("shm_control").decode()
