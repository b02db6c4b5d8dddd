"""Threads per rank on CPU ranks: Horovod's synthetic benchmark (resnet18 on random 224x224
images, SGD, images/s per rank) with hvd.DistributedOptimizer and with torch DDP over Gloo, at
several intra-op thread counts. The systems run in the same processes and take turns step by
step, so a change of load on a shared machine hits all of them alike. Per system it prints the
median images/s per rank, the allreduce calls per step, and the CPU seconds per step of each kind
of thread of rank 0 and their context switches (--threads-report).

    torchrun --nproc_per_node=2 examples/bench_cpu_threads.py --systems hvd:1,ddp:1,hvd:2,ddp:2

A system is `hvd:T`, `hvd-gN:T` (DistributedOptimizer(groups=N)) or `ddp:T`, T the threads
(torch.set_num_threads) while it steps. Needs torchvision (for the model only).
"""

import argparse
import collections
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import horovod_zero.torch as hvd
from bench_cpu_step import thread_cpu  # examples/, this script's folder


class System:
    """One model and optimizer, wrapped as `spec` says, and what its steps took."""

    def __init__(self, spec: str):
        self.name = spec
        kind, threads = spec.split(":")
        self.threads = int(threads)
        torch.manual_seed(0)
        self.model = torchvision.models.resnet18()
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.ddp_calls = 0
        if kind == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
            self.model.register_comm_hook(None, self._counting_allreduce)
        else:
            groups = int(kind.split("-g")[1]) if "-g" in kind else None
            opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(), groups=groups)
        self.opt, self.kind = opt, kind
        self.rates, self.calls, self.cpu, self.switches = [], 0, collections.Counter(), collections.Counter()

    def _counting_allreduce(self, state, bucket):
        self.ddp_calls += 1
        return default_hooks.allreduce_hook(None, bucket)

    def step(self, data, target):
        torch.set_num_threads(self.threads)
        before = (time.perf_counter(), _allreduces(), self.ddp_calls, thread_cpu(), _switches())
        self.opt.zero_grad()
        F.cross_entropy(self.model(data), target).backward()
        self.opt.step()
        self.rates.append(data.shape[0] / (time.perf_counter() - before[0]))
        self.calls += self.ddp_calls - before[2] if self.kind == "ddp" else _allreduces() - before[1]
        for key, seconds in thread_cpu().items():
            self.cpu[_kind_of_thread(key)] += seconds - before[3].get(key, 0.0)
        self.switches.update(_switches() - before[4])


def _switches() -> collections.Counter:
    """Context switches so far, by thread kind: "<name> wakes" (voluntary: the thread slept and
    was woken) and "<name> preempted" (involuntary: descheduled while it could run)."""
    out = collections.Counter()
    main = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "main" if int(tid) == main else f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        kind = "wakes" if line.startswith("voluntary") else "preempted"
                        out[f"{name} {kind}"] += int(line.split()[1])
        except OSError:
            continue  # the thread has exited
    return out


def _allreduces() -> int:
    return sum(row["collectives"] for row in hvd.collective_stats() if row["op"] == "allreduce")


def _kind_of_thread(key: str) -> str:
    """thread_cpu()'s "name#tid" without the id: threads of one kind share a name."""
    return key.rsplit("#", 1)[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--systems", default="hvd:1,ddp:1,hvd:2,ddp:2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="steps of each system before timing")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each system")
    p.add_argument("--threads-report", action="store_true")
    a = p.parse_args()

    hvd.init()
    dist.init_process_group("gloo")
    systems = [System(s) for s in a.systems.split(",")]
    for s in systems:
        if s.kind != "ddp":
            hvd.broadcast_parameters(s.model.state_dict(), root_rank=0)
    data = torch.randn(a.batch_size, 3, 224, 224)
    target = torch.randint(0, 1000, (a.batch_size,))
    for _ in range(a.warmup):
        for s in systems:
            s.step(data, target)
    for s in systems:
        s.rates, s.calls, s.cpu, s.switches = [], 0, collections.Counter(), collections.Counter()
    for _ in range(a.steps):
        for s in systems:
            s.step(data, target)
    if hvd.rank() == 0:
        for s in systems:
            print(f"{s.name:10s} images/s per rank: median {statistics.median(s.rates):6.2f} "
                  f"[{min(s.rates):.2f}-{max(s.rates):.2f}]  allreduces/step {s.calls / a.steps:5.1f}", flush=True)
            if a.threads_report:
                print("    CPU s/step: " + " ".join(f"{k}={v / a.steps:.2f}" for k, v in s.cpu.most_common()
                                                    if v / a.steps >= 0.01), flush=True)
                print("    switches/step: " + " ".join(f"{k}={v / a.steps:.0f}" for k, v in s.switches.most_common(8)),
                      flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
