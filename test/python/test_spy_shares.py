"""examples/spy_shares.py: py-spy's raw samples, per thread and as the tree below a frame, from a
file of known stacks (one process, and a child under --subprocesses)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import spy_shares  # noqa: E402

RAW = """\
process 10:"python3 train.py";thread (10): MainThread;main (train.py:5);step (train.py:9);0x7f01 (libc.so.6) 6
process 10:"python3 train.py";thread (10): MainThread;main (train.py:5);step (train.py:9);hook (zero.py:3) 3
process 10:"python3 train.py";thread (10): MainThread;main (train.py:5);forward (train.py:7) 1
process 10:"python3 train.py";thread (11);loop (runtime.cc) 4
process 1:"torchrun";process 20:"python3 rank.py";thread (20): MainThread;main (rank.py:2);step (train.py:9) 2
"""


def test_samples_per_thread_and_the_frames_on_their_stacks(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    rows = list(spy_shares.read(path))
    assert len(rows) == 5
    # Under --subprocesses the process is the last of the ancestors before the thread.
    assert rows[-1][:2] == ('process 20:"python3 rank.py"', "thread (20): MainThread")
    threads = spy_shares.per_thread(rows)
    total, frames = threads[('process 10:"python3 train.py"', "thread (10): MainThread")]
    assert total == 10
    assert frames["main (train.py:5)"] == 10 and frames["step (train.py:9)"] == 9 and frames["hook (zero.py:3)"] == 3
    assert threads[('process 10:"python3 train.py"', "thread (11)")][0] == 4
    assert threads[('process 20:"python3 rank.py"', "thread (20): MainThread")][0] == 2


def test_the_tree_below_a_frame_leaves_out_bare_addresses(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    tree = spy_shares.tree_under(list(spy_shares.read(path)), "step (", depth=2)
    assert tree[()] == 11  # 6 + 3 on thread 10, 2 in the child
    assert tree[("hook (zero.py:3)",)] == 3
    assert not any(p and p[0].startswith("0x") for p in tree)
    assert spy_shares.tree_under(list(spy_shares.read(path)), "nowhere", depth=2) == {}
