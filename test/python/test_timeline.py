"""HOROVOD_TIMELINE writes a Chrome-trace JSON with a span per phase of each tensor;
hvd.start_timeline / stop_timeline record it for part of a run, as Horovod's do:
rank 0 writes, a second start switches files, a stop without a start does nothing,
mark_cycles adds an instant CYCLE_START event per cycle."""

import json
import os
import sys

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import timeline_late  # noqa: E402


def _with_timeline():
    hvd.init()
    hvd.grouped_allreduce([torch.ones(4), torch.ones(5)], name="traced")
    hvd.allgather(torch.ones(2, 2), name="traced_gather")
    hvd.shutdown()


def test_timeline_is_valid_json_with_phase_spans(tmp_path):
    path = tmp_path / "timeline.json"
    res = launch(_with_timeline, 2, env={"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"},
                 timeout=60)
    assert all(s == "ok" for s, _ in res.values()), res
    events = json.loads(path.read_text())  # rank 0 writes it, as in Horovod: the coordinator's view
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = {(tracks[e["tid"]], e["name"]) for e in events if e.get("ph") == "X"}
    # A fused group has all four phases; a lone even allgather is gathered in place
    # into its output, so it has no copy-out.
    expected = {"traced.0": ("NEGOTIATE", "QUEUE", "COPY_IN", "COLLECTIVE", "COPY_OUT"),
                "traced.1": ("NEGOTIATE", "QUEUE", "COPY_IN", "COLLECTIVE", "COPY_OUT"),
                "traced_gather": ("NEGOTIATE", "QUEUE", "COPY_IN", "COLLECTIVE")}
    for name, phases in expected.items():
        for phase in phases:
            assert (name, phase) in spans, (name, phase, sorted(spans))


def _one_late():
    import time
    hvd.init()
    for _ in range(2):  # through the coordinator, then from the response cache
        if hvd.rank() == 1:
            time.sleep(0.3)
        hvd.allreduce(torch.ones(2), name="waits_for_rank_1")
    hvd.shutdown()


def test_the_timeline_marks_when_each_rank_submitted(tmp_path):
    path = tmp_path / "timeline.json"
    res = launch(_one_late, 2, env={"HOROVOD_TIMELINE": str(path)}, timeout=60)
    assert all(s == "ok" for s, _ in res.values()), res
    events = json.loads(path.read_text())
    track = next(e["tid"] for e in events if e.get("ph") == "M" and e["args"]["name"] == "waits_for_rank_1")
    marks = sorted((e["ts"], e["name"]) for e in events if e["tid"] == track and e["ph"] == "i")
    # Per round, rank 0's submission, then rank 1's 0.3 s later; the negotiation ends at the last.
    assert [name for _, name in marks] == ["0", "1", "0", "1"], marks
    for (t0, _), (t1, _) in zip(marks[::2], marks[1::2]):
        assert t1 - t0 > 200e3, marks
    ends = sorted(e["ts"] + e["dur"] for e in events if e["tid"] == track and e["name"] == "NEGOTIATE")
    assert len(ends) == 2 and all(end >= t1 for end, (t1, _) in zip(ends, marks[1::2])), (ends, marks)
    # examples/timeline_late.py reads the same: rank 1 last in both rounds, 0.3 s behind.
    table = timeline_late.summarize(timeline_late.negotiations(events))
    row = table["other"]
    assert row["negotiations"] == 2 and list(row["last"]) == [1] and row["last"][1][0] == 2, table
    assert row["spread_median_ms"] > 200, table
    assert timeline_late.summarize(timeline_late.negotiations(events, skip=1))["other"]["negotiations"] == 1


def _recorded(path):
    """The tensors with spans in a timeline file, and whether it marks cycles; the
    file must be a complete Chrome-trace JSON array."""
    events = json.loads(path.read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return {tracks[e["tid"]] for e in events if e["ph"] == "X"}, any(e["name"] == "CYCLE_START" for e in events)


def _start_and_stop(tmp):
    first, second, third = (f"{tmp}/{name}.json" for name in ("first", "second", "third"))
    hvd.stop_timeline()  # none running: does nothing
    hvd.allreduce(torch.ones(3), name="tl.before")
    hvd.start_timeline(first, mark_cycles=True)
    hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], name="tl.first")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="tl.stopped")
    hvd.start_timeline(second)
    hvd.allgather(torch.ones(2, 2), name="tl.second")
    hvd.start_timeline(third)  # switches: the second file is closed, complete
    hvd.broadcast(torch.ones(2), root_rank=0, name="tl.third")
    hvd.stop_timeline()
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with pytest.raises(ValueError, match="Cannot open the timeline file"):
            hvd.start_timeline(f"{tmp}/no/such/dir/t.json")
    else:
        hvd.start_timeline(f"{tmp}/no/such/dir/t.json")  # only rank 0 writes: nothing to open here
    hvd.allreduce(torch.ones(1), name="tl.after")
    return True


def test_start_and_stop_timeline_at_run_time(ranks, tmp_path):
    tmp = tmp_path
    ranks.run(_start_and_stop, str(tmp))
    assert _recorded(tmp / "first.json") == ({"tl.first.0", "tl.first.1"}, True)
    assert _recorded(tmp / "second.json") == ({"tl.second"}, False)
    assert _recorded(tmp / "third.json") == ({"tl.third"}, False)
    assert sorted(p.name for p in tmp.iterdir()) == ["first.json", "second.json", "third.json"]


def test_start_timeline_needs_init():
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.start_timeline("unused.json")
