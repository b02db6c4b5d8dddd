"""examples/thread_sched.py (what each thread did between two moments), examples/gc_watch.py
(the collector's runs during a script) and examples/pin_threads.py (a rank's threads pinned by
role), on inputs whose answer is known: hand-made snapshots and a thread that spins then
sleeps, a child that makes cycles with the collector on and off (and a finalizer that collects
inside a collection), and a thread the watcher pins; and examples/cpu_speed.py (one CPU's speed
beside a spinner on each other CPU), whose output must name every other CPU once."""

import os
import subprocess
import sys
import threading
import time

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import pin_threads  # noqa: E402
import thread_sched  # noqa: E402

CYCLES = """
import gc, sys
class Node:
    pass
for _ in range(200000):  # cycles only the collector frees
    a, b = Node(), Node()
    a.other, b.other = b, a
class Collects:
    def __del__(self):
        gc.collect()  # inside the collection that frees it
c = Collects()
c.self = c
del c
gc.collect()
print("child args", sys.argv[1:])
"""


def test_time_between_snapshots_is_split_into_running_waiting_and_blocked():
    a = (0, {"1": ("main", 0, 0), "2": ("worker", 1_000_000, 0), "3": ("worker", 0, 0), "9": ("gone", 0, 0)})
    # 10 ms later: main ran 6 ms and waited 1 ms for a CPU; the workers ran 2 and 1 ms; thread 4
    # started in between (its blocked time is unknown); thread 9 ended; thread 3 renamed itself.
    b = (10_000_000, {"1": ("main", 6_000_000, 1_000_000), "2": ("worker", 3_000_000, 0),
                      "3": ("hvdz-cycle", 1_000_000, 0), "4": ("late", 500_000, 0)})
    wall, threads = thread_sched.Snapshots.between(a, b)
    assert wall == 10.0
    assert threads == {"main": [6.0, 1.0, 3.0], "worker": [2.0, 0.0, 8.0], "hvdz-cycle": [1.0, 0.0, 9.0],
                       "late": [0.5, 0.0, 0.0]}


def test_a_spinning_thread_shows_as_running_and_a_sleeping_one_as_blocked():
    snaps = thread_sched.Snapshots()
    a = snaps.take()
    end = time.thread_time() + 0.05  # 50 ms on a CPU, however long a loaded machine takes to give it
    while time.thread_time() < end:
        pass
    time.sleep(0.05)
    wall, threads = snaps.between(a, snaps.take())
    me = next(name for tid, (name, _, _) in a[1].items() if int(tid) == threading.get_native_id())
    run, wait, blocked = threads[me]
    assert wall >= 100 and len(snaps.cost_ns) == 2
    assert run >= 45 and blocked >= 40, (run, wait, blocked)


def run_watched(tmp_path, mode):
    script = tmp_path / "cycles.py"
    script.write_text(CYCLES)
    env = dict(os.environ, GC_MODE=mode, RANK="3")
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, "gc_watch.py"), str(script), "--x", "1"],
                          env=env, capture_output=True, text=True, check=True).stdout


def test_automatic_collections_are_counted_apart_from_asked_ones(tmp_path):
    out = run_watched(tmp_path, "on")
    assert "child args ['--x', '1']" in out
    line = next(x for x in out.splitlines() if x.startswith("gc_watch rank 3 (GC_MODE=on)"))
    assert "automatic: gen0 " in line  # 400000 tracked objects trigger young collections
    assert "asked for" in line


def test_no_automatic_collection_runs_with_gc_mode_off(tmp_path):
    # The child's gc.collect() frees an object whose finalizer calls gc.collect() again, which
    # returns at once; the outer collection still counts as asked for, not automatic.
    line = next(x for x in run_watched(tmp_path, "off").splitlines() if x.startswith("gc_watch rank 3"))
    assert "automatic: none" in line and "1 asked for" in line, line


def test_roles_get_disjoint_parts_of_the_rank_share():
    where = pin_threads.placement(list(range(16, 32)), "all")
    assert where == {"main": [16], "autograd": [18], "runtime": [24, 25, 26, 27], "other": [28, 29, 30, 31]}
    assert pin_threads.placement(list(range(16)), "runtime") == {"runtime": [8, 9, 10, 11]}
    assert pin_threads.role(os.getpid(), "python3") == "main"
    assert pin_threads.role(1, "pt_autograd_0") == "autograd"
    assert pin_threads.role(1, "hvdz-cycle") == "runtime"
    assert pin_threads.role(1, "pt_gloo_runloop") == "other"


def test_too_small_a_share_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))
    with pytest.raises(SystemExit, match="it needs 8"):
        pin_threads.share()


def test_the_watcher_pins_a_thread_by_its_role_and_leaves_itself_alone():
    cpu = max(os.sched_getaffinity(0))
    stop, seen = threading.Event(), {}

    def worker():
        time.sleep(1.5)  # the watcher scans every half second
        seen["worker"] = os.sched_getaffinity(0)
    t = threading.Thread(target=worker)
    t.start()
    watcher = threading.Thread(target=pin_threads.watch, args=({"other": [cpu]}, stop))
    watcher.start()
    t.join()
    stop.set()
    watcher.join()
    assert seen["worker"] == {cpu}
    assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1  # main: role "main", not moved


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_cpu_speed_times_one_cpu_alone_and_beside_each_other_cpu():
    cpus = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "cpu_speed.py"), str(cpus[0]), "5"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    alone = out[0].split(": ")[1].split()
    assert len(alone) == 3 and all(float(x) > 0 for x in alone), out
    beside = dict(item.split(":") for item in out[1].split(": ", 1)[1].split(", "))
    assert sorted(map(int, beside)) == cpus[1:], out  # every other CPU once, never the probe's own
    assert all(float(v) > 0 for v in beside.values()), out


def test_cpu_speed_refuses_a_cpu_it_may_not_use():
    bad = max(os.sched_getaffinity(0)) + 1
    res = subprocess.run([sys.executable, os.path.join(EXAMPLES, "cpu_speed.py"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and f"CPU {bad} is not one this process may use" in res.stderr
