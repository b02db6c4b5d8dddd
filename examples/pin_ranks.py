"""Runs a script with this local rank pinned to its own share of the machine's physical
cores (one hardware thread of each; PIN_SMT=1 adds their siblings). Threads the script
starts inherit the pinning. PIN_SHARES=N splits the cores N ways instead of one way per
local rank (a single rank then gets what it would have with N ranks).

    torchrun --nproc_per_node=2 examples/pin_ranks.py examples/bench_zero.py --micro-batch 1 ...
"""
import os
import runpy
import sys


def cpu_list(text):
    """'0-3,8' -> [0, 1, 2, 3, 8]: the kernel's CPU list format."""
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def physical_cores(cpus):
    """(first hardware thread, its siblings) per physical core among `cpus`, in order."""
    seen, cores = set(), []
    for cpu in sorted(cpus):
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            siblings = f.read().strip()
        if siblings not in seen:
            seen.add(siblings)
            cores.append((cpu, [c for c in cpu_list(siblings) if c in cpus]))
    return cores


def share(cores, index, shares, smt):
    """The CPUs of share `index` of `shares` equal parts of `cores`."""
    per = len(cores) // shares
    if per == 0:
        raise SystemExit(f"pin_ranks: {len(cores)} physical cores cannot be split {shares} ways.")
    mine = cores[index * per:(index + 1) * per]
    return [c for first, siblings in mine for c in (siblings if smt else [first])]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    shares = int(os.environ.get("PIN_SHARES") or os.environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = share(physical_cores(os.sched_getaffinity(0)), rank, shares, os.environ.get("PIN_SMT") == "1")
    os.sched_setaffinity(0, cpus)
    print(f"local rank {rank}: pinned to CPUs {cpus}", flush=True)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
