"""Runs a script and says, per rank at its end, how often Python's cyclic garbage
collector ran and how long it held the interpreter: a collection stops every Python
thread of the process, so one that lands in a rank's backward delays that rank alone.
Collections the script asks for (gc.collect()) are counted apart. GC_MODE=off runs the
script with automatic collection disabled, to compare the steps without it.

    torchrun --nproc_per_node=2 examples/gc_watch.py examples/bench_zero.py --micro-batch 1 ...
"""
import gc
import os
import runpy
import sys
import time


class Watch:
    def __init__(self):
        self.automatic = {}  # generation -> durations in s
        self.asked = []  # durations of gc.collect() calls, in s
        self._began = None
        self._explicit = 0  # gc.collect() calls in progress (a finalizer may call it again)

    def __call__(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        if self._explicit:
            self.asked.append(took)
        else:
            self.automatic.setdefault(info["generation"], []).append(took)

    def collect(self, original):
        def explicit(*args, **kwargs):
            self._explicit += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._explicit -= 1
        return explicit

    def report(self, rank):
        parts = []
        for gen in sorted(self.automatic):
            d = self.automatic[gen]
            parts.append(f"gen{gen} {len(d)} runs, {1e3 * sum(d):.1f} ms in all, longest {1e3 * max(d):.2f} ms")
        slow = sum(1 for d in self.automatic.values() for x in d if x > 1e-3)
        auto = "; ".join(parts) or "none"
        asked = f"{len(self.asked)} asked for, {1e3 * sum(self.asked):.1f} ms"
        print(f"gc_watch rank {rank} (GC_MODE={os.environ.get('GC_MODE', 'on')}): automatic: {auto}; "
              f"{slow} over 1 ms; {asked}", flush=True)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    watch = Watch()
    gc.callbacks.append(watch)
    gc.collect = watch.collect(gc.collect)
    if os.environ.get("GC_MODE", "on") == "off":
        gc.disable()
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        watch.report(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    main()
