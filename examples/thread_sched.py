"""What each thread of this process did between two moments, from the kernel's scheduler
statistics (/proc/self/task/*/schedstat, Linux): time on a CPU, time waiting for one, and
the rest of the wall time, in which the thread was blocked (a lock, a sleep, a wait on the
GPU or on another rank). A phase that runs long on one rank is then either slower work
(more time on a CPU), a crowded machine (waiting for a CPU) or a wait (blocked)."""
import os
import time

TASKS = "/proc/self/task"


def _read(path):
    with open(path) as f:
        return f.read()


class Snapshots:
    def __init__(self):
        self.cost_ns = []  # what each take() cost the calling thread, wall time

    def take(self):
        """(wall ns, {tid: (name, on a CPU ns, waiting for a CPU ns)}); the time is taken
        before the threads are read, so each interval carries one read's cost."""
        t = time.perf_counter_ns()
        out = {}
        for tid in os.listdir(TASKS):
            try:
                run, wait, _ = _read(f"{TASKS}/{tid}/schedstat").split()
                out[tid] = (_read(f"{TASKS}/{tid}/comm").strip(), int(run), int(wait))
            except (OSError, ValueError):
                continue  # the thread ended meanwhile
        self.cost_ns.append(time.perf_counter_ns() - t)
        return t, out

    @staticmethod
    def between(a, b):
        """{thread name: [on a CPU, waiting, blocked] in ms} from snapshot a to b, by the name
        each thread has at b; threads of one name (NCCL's, Gloo's) are summed, so their
        blocked time counts once per thread. A thread that started in between counts its
        time on a CPU and waiting, not blocked: when it began is unknown. A thread that ended
        in between is not counted."""
        wall = (b[0] - a[0]) / 1e6
        out = {}
        for tid, (name, run, wait) in b[1].items():
            before = a[1].get(tid)
            new = before is None
            run0, wait0 = (0, 0) if new else before[1:]
            r, w = max(run - run0, 0) / 1e6, max(wait - wait0, 0) / 1e6
            row = out.setdefault(name, [0.0, 0.0, 0.0])
            row[0] += r
            row[1] += w
            row[2] += 0.0 if new else max(wall - r - w, 0.0)
        return wall, out

