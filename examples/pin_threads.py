"""Runs a script with this local rank's threads pinned by role, inside the rank's share of
the machine's CPUs: to test whether where the threads run sets the host's speed at
micro-batch 1. A watcher thread pins each thread it sees (every half second) by its name:

- PIN_ROLES=all: the main thread to the share's first CPU, autograd's threads to its third,
  the runtime's (hvdz-*) to the third quarter of the share, every other thread to the last
  quarter; the rest of the share stays idle, so that nothing runs beside the two threads
  that issue the model's work;
- PIN_ROLES=runtime: only the runtime's threads move (to the third quarter); the others
  stay where the scheduler puts them.

    PIN_ROLES=all torchrun --nproc_per_node=2 examples/pin_threads.py examples/profile_host.py zero2
"""
import os
import runpy
import sys
import threading

TASKS = "/proc/self/task"


def share():
    """This local rank's equal part of the CPUs the process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per = len(cpus) // ranks
    if per < 8:
        raise SystemExit(f"pin_threads: {len(cpus)} CPUs give each of {ranks} ranks {per}; it needs 8.")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    return cpus[rank * per:(rank + 1) * per]


def placement(mine, roles):
    """role -> CPUs, for the roles PIN_ROLES moves."""
    q = len(mine) // 4
    runtime = mine[2 * q:3 * q]
    if roles == "runtime":
        return {"runtime": runtime}
    return {"main": mine[:1], "autograd": mine[2:3], "runtime": runtime, "other": mine[3 * q:]}


def role(tid, name):
    if tid == os.getpid():
        return "main"
    if name.startswith("pt_autograd"):
        return "autograd"
    if name.startswith("hvdz-"):
        return "runtime"
    return "other"


def watch(where, stop):
    seen = {}  # tid -> the name it was pinned under (threads name themselves after they start)
    while not stop.wait(0.5):
        for entry in os.listdir(TASKS):
            tid = int(entry)
            if tid == threading.get_native_id():
                continue
            try:
                with open(f"{TASKS}/{entry}/comm") as f:
                    name = f.read().strip()
                if seen.get(tid) == name:
                    continue
                cpus = where.get(role(tid, name))
                if cpus:
                    os.sched_setaffinity(tid, cpus)
            except OSError:
                continue  # the thread ended meanwhile
            seen[tid] = name


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    roles = os.environ.get("PIN_ROLES", "all")
    if roles not in ("all", "runtime"):
        raise SystemExit(f"pin_threads: PIN_ROLES={roles!r}; use all or runtime.")
    where = placement(share(), roles)
    print(f"local rank {os.environ.get('LOCAL_RANK', 0)}: {roles}: {where}", flush=True)
    stop = threading.Event()
    threading.Thread(target=watch, args=(where, stop), name="pin-threads", daemon=True).start()
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        stop.set()


if __name__ == "__main__":
    main()
