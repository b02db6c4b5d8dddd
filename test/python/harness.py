"""Multi-process test harness: N ranks on one machine over Gloo (CPU) or NCCL (GPU).

A RankPool keeps N worker processes alive, each with hvd.init() done once, and
runs test functions on all of them (functions must be defined at module level,
so that they can be sent by name). launch() starts fresh processes for tests that
break the job (dead peers, stalls) or change its environment.
"""

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

_CTX = mp.get_context("spawn")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, size, port, extra=None):
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


@contextlib.contextmanager
def scoped_env(**values):
    """Sets environment variables inside a rank process for the duration of a block
    (for settings read when an object is built, such as HOROVOD_ZERO_*), then puts
    back what was there before, so that the pool's later tests never see them."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _apply_env(env):
    for k in ("HOROVOD_RANK", "HOROVOD_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(env)


def _worker(env, inbox, outbox):
    _apply_env(env)
    rank = int(env["RANK"])
    try:
        import horovod_zero.torch as hvd
        hvd.init()
        outbox.put((rank, "ok", None))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, "ok", fn(*args)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
    hvd.shutdown()


class RankPool:
    def __init__(self, size, env=None, timeout=120):
        self.size = size
        self.broken = False
        port = free_port()
        self._inboxes = [_CTX.Queue() for _ in range(size)]
        self._outbox = _CTX.Queue()
        self._procs = [
            _CTX.Process(target=_worker, args=(rank_env(r, size, port, env), self._inboxes[r], self._outbox), daemon=True)
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self._collect(timeout, "init")

    def _collect(self, timeout, what):
        results, errors = [None] * self.size, []
        for _ in range(self.size):
            try:
                rank, status, value = self._outbox.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)  # its ranks may be inside a collective: none can be reused
                self.broken = True
                raise TimeoutError(f"{what}: not every rank answered within {timeout} s") from None
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout=120):
        """Runs fn(*args) on every rank; returns the per-rank results in rank order."""
        for q in self._inboxes:
            q.put((fn, args))
        return self._collect(timeout, fn.__name__)

    def close(self, force=False):
        if not force:
            for q in self._inboxes:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10 if not force else 0.1)
            if p.is_alive():
                p.kill()


def _launched(env, fn, args, outbox):
    _apply_env(env)
    rank = int(env["RANK"])
    try:
        outbox.put((rank, "ok", fn(*args)))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))


def launch(fn, size, *args, env=None, timeout=120):
    """Runs fn(*args) in `size` fresh processes (fn calls hvd.init() itself).
    Returns {rank: ("ok", result) | ("error", traceback)}; ranks that exit without
    answering are missing from it."""
    port = free_port()
    outbox = _CTX.Queue()
    # env: a dict for every rank, or rank -> dict (e.g. simulated nodes).
    procs = [_CTX.Process(target=_launched, args=(rank_env(r, size, port, env(r) if callable(env) else env), fn, args,
                                                  outbox)) for r in range(size)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < size and time.monotonic() < deadline:
        try:
            rank, status, value = outbox.get(timeout=0.2)
            out[rank] = (status, value)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and outbox.empty():
                break  # a rank that died will never answer
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return out


_shared = {}


def shared_pool(size, fusion=True, env=None):
    """A RankPool shared by every test that asks for the same configuration
    (`env`: extra environment variables); closed at exit. One that timed out is replaced,
    so that a hang fails its own test only, not every later one."""
    key = (size, fusion, tuple(sorted((env or {}).items())))
    if key not in _shared or _shared[key].broken:
        full = dict(env or {})
        if not fusion:
            full["HOROVOD_FUSION_THRESHOLD"] = "0"
        _shared[key] = RankPool(size, full)
    return _shared[key]


def close_shared_pools():
    for p in _shared.values():
        p.close()
    _shared.clear()


def on_gpus(*sizes):
    """Rank counts for GPU tests as pytest parameters, a rank on each GPU: each is
    marked gpus(n), so that test/gpu/conftest.py runs it only where n GPUs are present."""
    import pytest  # here: rank processes import this module too, and never need pytest
    return [pytest.param(n, id=f"{n}gpu" if n == 1 else f"{n}gpus", marks=pytest.mark.gpus(n)) for n in sizes]
