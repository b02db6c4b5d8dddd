"""How fast one CPU runs the same piece of Python, alone and with a spinning process on each
other CPU in turn: a core shared with another CPU (a sibling hidden by the hypervisor) shows as
one CPU that always slows it; a host that runs other guests' work shows as a speed that changes
over time, whichever CPU spins. Prints the median of REPS timings (ms) of profile_host.py's
probe (the same 20000-iteration sum), three times alone, then per spinning CPU.

    python examples/cpu_speed.py CPU [REPS]
"""
import multiprocessing as mp
import os
import statistics
import sys
import time


def probe_ms(reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sum(i * i for i in range(20000))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _spin(cpu, stop):
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i


def with_spinner(cpu, reps):
    stop = mp.Event()
    spinner = mp.Process(target=_spin, args=(cpu, stop), daemon=True)
    spinner.start()
    try:
        time.sleep(0.05)  # on its CPU before the timing starts
        return probe_ms(reps)
    finally:
        stop.set()
        spinner.join()


def main(argv):
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__)
    cpu, reps = int(argv[0]), int(argv[1]) if len(argv) > 1 else 150
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise SystemExit(f"cpu_speed: CPU {cpu} is not one this process may use ({allowed[0]}-{allowed[-1]}).")
    os.sched_setaffinity(0, {cpu})
    print(f"cpu {cpu} alone: " + " ".join(f"{probe_ms(reps):.3f}" for _ in range(3)), flush=True)
    rows = [(with_spinner(k, reps), k) for k in allowed if k != cpu]
    print(f"cpu {cpu} with a spinner on (slowest first): " + ", ".join(f"{k}:{m:.3f}" for m, k in sorted(rows, reverse=True)),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
