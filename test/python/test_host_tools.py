"""examples/thread_sched.py (what each thread did between two moments), examples/gc_watch.py
(the collector's runs during a script) and examples/pin_threads.py (a rank's threads pinned by
role), on inputs whose answer is known: hand-made snapshots, a child that makes cycles with the
collector on and off, and a child whose threads are pinned."""

import os
import subprocess
import sys
import time

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
gc.collect()
print("child args", sys.argv[1:])
"""


def test_time_between_snapshots_is_split_into_running_waiting_and_blocked():
    snaps = thread_sched.Snapshots()
    snaps._names = {"1": "main", "2": "worker", "3": "worker"}
    a = (0, {"1": (0, 0), "2": (1_000_000, 0), "3": (0, 0)})
    # 10 ms later: main ran 6 ms and waited 1 ms for a CPU; the workers ran 2 and 1 ms; thread 4 is new.
    b = (10_000_000, {"1": (6_000_000, 1_000_000), "2": (3_000_000, 0), "3": (1_000_000, 0),
                      "4": (500_000, 0)})
    snaps._names["4"] = "late"
    wall, threads = snaps.between(a, b)
    assert wall == 10.0
    assert threads["main"] == [6.0, 1.0, 3.0]
    assert threads["worker"] == [3.0, 0.0, 17.0]  # blocked counted once per thread of the name
    assert threads["late"] == [0.5, 0.0, 9.5]


def test_a_spinning_thread_shows_as_running_and_a_sleeping_one_as_blocked():
    snaps = thread_sched.Snapshots()
    a = snaps.take()
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
    time.sleep(0.05)
    wall, threads = snaps.between(a, snaps.take())
    run, wait, blocked = threads[thread_sched._name(str(os.getpid()))]
    assert wall >= 100
    assert run >= 40 and blocked >= 40, (run, wait, blocked)


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
    assert "1 asked for" in line


def test_no_automatic_collection_runs_with_gc_mode_off(tmp_path):
    line = next(x for x in run_watched(tmp_path, "off").splitlines() if x.startswith("gc_watch rank 3"))
    assert "automatic: none" in line and "1 asked for" in line


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
    try:
        pin_threads.share()
    except SystemExit as e:
        assert "it needs 8" in str(e)
    else:
        raise AssertionError("a share of one CPU was accepted")
