"""examples/trace_api.py (CUDA API time per thread, from a profiler trace) and
examples/pin_ranks.py (each local rank on its own share of the cores) and
examples/timeline_late.py (which rank submits last), on inputs whose answer is known: a
hand-made trace, a made-up core layout, a real pinned child and hand-made rounds."""

import gzip
import json
import os
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
import pin_ranks  # noqa: E402
import timeline_late  # noqa: E402
import trace_api  # noqa: E402


def test_api_calls_are_summed_per_thread_and_call(tmp_path):
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "dur": 5.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "dur": 7.0},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "tid": 2, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 3, "dur": 900.0},  # GPU time: not a call
        {"ph": "i", "cat": "cuda_runtime", "name": "marker", "tid": 1},  # no duration: not a call
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    calls = trace_api.api_calls(trace_api.load_events(str(path)))
    assert {tid: dict(c) for tid, c in calls.items()} == {1: {"cudaLaunchKernel": [5.0, 7.0]},
                                                          2: {"cuLaunchKernelEx": [30.0]}}
    text = trace_api.report(str(path), steps=2, top=5)
    # The costlier thread first; per step: 30 us over 2 steps is 0.015 ms.
    assert text.index("thread 2") < text.index("thread 1")
    assert "thread 1: 1 calls, 0.01 ms per step" in text
    assert "mean    6.0 us  median    6.0 us" in text


def test_cores_are_split_evenly_one_thread_each_unless_asked():
    # Four physical cores with two hardware threads each, as the kernel lists siblings.
    cores = [(0, [0, 4]), (1, [1, 5]), (2, [2, 6]), (3, [3, 7])]
    assert pin_ranks.share(cores, 0, 2, smt=False) == [0, 1]
    assert pin_ranks.share(cores, 1, 2, smt=False) == [2, 3]
    assert pin_ranks.share(cores, 1, 2, smt=True) == [2, 6, 3, 7]
    assert pin_ranks.cpu_list("0-2,8") == [0, 1, 2, 8]


def test_too_few_cores_for_the_shares_is_refused():
    try:
        pin_ranks.share([(0, [0])], 0, 2, smt=False)
    except SystemExit as e:
        assert "cannot be split 2 ways" in str(e)
    else:
        raise AssertionError("one core split two ways was accepted")


def test_the_script_runs_pinned_with_its_own_arguments(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import os, sys\nprint('child', sorted(os.sched_getaffinity(0)), sys.argv[1:])\n")
    env = dict(os.environ, LOCAL_RANK="0", PIN_SHARES="1")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "pin_ranks.py"), str(script), "--x", "1"],
                         env=env, capture_output=True, text=True, check=True).stdout
    expected = pin_ranks.share(pin_ranks.physical_cores(os.sched_getaffinity(0)), 0, 1, smt=False)
    assert f"child {sorted(expected)} ['--x', '1']" in out


def test_the_late_rank_is_counted_per_kind_and_partial_rounds_are_left_out():
    rounds = [("zero.param.1", {0: 0.0, 1: 500.0, 2: 100.0}),
              ("zero.param.2", {0: 2000.0, 1: 0.0, 2: 0.0}),  # ranks 0 late by 2 ms
              ("zero.param.1", {1: 0.0, 2: 50.0}),  # rank 0 submitted before the timeline began
              ("zero.grad.3.0", {0: 0.0, 1: 0.0, 2: 300.0})]
    table = timeline_late.summarize(rounds)
    gathers = table["parameter gathers"]
    assert gathers["negotiations"] == 2
    assert gathers["last"] == {1: (1, 0.5), 0: (1, 2.0)}
    assert gathers["spread_median_ms"] == 1.25
    assert table["gradient reductions"]["last"] == {2: (1, 0.3)}
