"""What each thread of this process did between two moments, from the kernel's scheduler
statistics (/proc/self/task/*/schedstat, Linux): time on a CPU, time waiting for one, and
the rest of the wall time, in which the thread was blocked (a lock, a sleep, a wait on the
GPU or on another rank). A phase that runs long on one rank is then either slower work
(more time on a CPU), a crowded machine (waiting for a CPU) or a wait (blocked)."""
import os
import time

TASKS = "/proc/self/task"


def _name(tid):
    try:
        with open(f"{TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class Snapshots:
    def __init__(self):
        self._names = {}

    def take(self):
        """(wall ns, {tid: (on a CPU ns, waiting for a CPU ns)})."""
        out = {}
        for tid in os.listdir(TASKS):
            try:
                with open(f"{TASKS}/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
            except (OSError, ValueError):
                continue  # the thread ended meanwhile
            out[tid] = (int(run), int(wait))
        return time.perf_counter_ns(), out

    def name(self, tid):
        if tid not in self._names:
            self._names[tid] = _name(tid)
        return self._names[tid]

    def between(self, a, b):
        """{thread name: [on a CPU, waiting, blocked] in ms} from snapshot a to b; threads of
        one name (NCCL's, Gloo's) are summed, so their blocked time counts once per thread."""
        wall = (b[0] - a[0]) / 1e6
        out = {}
        for tid, (run, wait) in b[1].items():
            run0, wait0 = a[1].get(tid, (0, 0))
            r, w = (run - run0) / 1e6, (wait - wait0) / 1e6
            row = out.setdefault(self.name(tid), [0.0, 0.0, 0.0])
            row[0] += r
            row[1] += w
            row[2] += max(wall - r - w, 0.0)
        return wall, out
