"""HOROVOD_THREAD_AFFINITY: Horovod's one entry per local rank, read and checked at
hvd.init(), and each rank's runtime threads pinned to its entry, read back from the
kernel (/proc/self/task/*/status), against their placement without it."""

import os
import time

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero import settings
from harness import launch

ALLOWED = sorted(os.sched_getaffinity(0))


def test_entries_are_cpu_ids_or_ranges_one_per_local_rank():
    assert settings.read({"HOROVOD_THREAD_AFFINITY": "7, 15"}).thread_affinity == ((7,), (15,))
    assert settings.read({"HOROVOD_THREAD_AFFINITY": "4-6,12-13"}).thread_affinity == ((4, 5, 6), (12, 13))
    assert settings.read({}).thread_affinity is None
    for bad in ("a,b", "3-1", "-1", "1,,2", "1.5"):
        with pytest.raises(ValueError, match="one CPU id per local rank"):
            settings.read({"HOROVOD_THREAD_AFFINITY": bad})


def test_each_local_rank_takes_its_own_entry_within_the_process_cpus():
    assert settings.thread_cpus(None, 0, 2, {0, 1}) == []
    assert settings.thread_cpus(((0,), (1,)), 1, 2, {0, 1}) == [1]
    assert settings.thread_cpus(((0, 1), (2, 3), (9,)), 1, 2, {0, 1, 2, 3}) == [2, 3]  # entries beyond are unused
    with pytest.raises(ValueError, match="1 entry for 2 local ranks: give one per local rank"):
        settings.thread_cpus(((0,),), 0, 2, {0, 1})
    with pytest.raises(ValueError, match=r"local rank 0 CPU 5, 9, outside the CPUs this process may use \(0-3,7\)"):
        settings.thread_cpus(((1, 5, 9),), 0, 1, {0, 1, 2, 3, 7})


def test_a_cpu_outside_the_process_is_refused_at_init(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOROVOD_THREAD_AFFINITY", str(max(ALLOWED) + 1))
    with pytest.raises(ValueError, match="outside the CPUs this process may use"):
        hvd.init()
    assert not hvd.is_initialized()


def _runtime_threads():
    """{thread name: CPUs it may run on} for the runtime's threads, once the cycle thread
    has started (it pins itself as it starts)."""
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/self/task/{tid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if name.startswith("hvdz-"):
                line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
                found[name] = line.split(":", 1)[1].strip()
        if "hvdz-cycle" in found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _placement():
    hvd.init()
    try:
        out = (hvd.local_rank(), hvd.runtime_info()["thread_cpus"], _runtime_threads(),
               sorted(os.sched_getaffinity(0)))
        total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="x")  # collectives still run on pinned threads
        assert total.tolist() == [hvd.size()] * 3
        return out
    finally:
        hvd.shutdown()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_each_rank_pins_its_runtime_threads_to_its_entry_and_still_works():
    cpus = ALLOWED[:2]
    res = launch(_placement, 2, env={"HOROVOD_THREAD_AFFINITY": f"{cpus[0]},{cpus[1]}"}, timeout=120)
    assert sorted(res) == [0, 1], res
    for rank, (status, value) in res.items():
        assert status == "ok", value
        local_rank, info, threads, process = value
        assert info == [cpus[local_rank]]
        assert threads.get("hvdz-cycle") == str(cpus[local_rank]), threads
        # The training threads keep every CPU the process had.
        assert process == ALLOWED


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_without_it_the_runtime_threads_keep_the_process_cpus():
    res = launch(_placement, 1, timeout=120)
    status, (local_rank, info, threads, process) = res[0]
    assert status == "ok"
    assert info == []
    assert threads.get("hvdz-cycle") == settings._cpu_text(ALLOWED), threads
