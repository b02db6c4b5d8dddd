"""The key-value store every rank meets on, and the Gloo process group built on it.

- torchrun: the TCPStore at MASTER_ADDR:MASTER_PORT.
- horovodrun: rank 0 starts a TCPStore and publishes its address through
  horovodrun's HTTP rendezvous server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT), under a
  scope of our own; the other ranks read it there.
- size 1: an in-process HashStore.
"""

import datetime
import os
import socket
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


def make_store(world: World, generation: int, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if world.size == 1:
        return dist.HashStore()
    if world.launcher == "horovodrun":
        store = _horovodrun_store(world, generation, timeout)
    else:
        store = _torchrun_store(world, timeout)
    # A prefix per init() generation keeps a re-init (and the user's own
    # torch.distributed use of the same store) from reading stale keys.
    return dist.PrefixStore(f"{SCOPE}/{generation}", store)


def make_gloo_backend(store, world: World, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
        return dist.ProcessGroupGloo(store, world.rank, world.size, opts)
    return dist.ProcessGroupGloo(store, world.rank, world.size, timeout)


def shm_control_name(store, world: World) -> str:
    """The shared-memory segment ranks negotiate through when they all share this
    host (HOROVOD_ZERO_SHM_CONTROL=0 turns it off); "" means negotiate over Gloo."""
    if world.size == 1 or world.local_size != world.size or os.environ.get("HOROVOD_ZERO_SHM_CONTROL", "1") == "0":
        return ""
    if world.rank == 0:
        store.set("shm_control", f"/hvdz_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    return store.get("shm_control").decode()
