"""HOROVOD_TIMELINE writes a Chrome-trace JSON with a span per phase of each tensor."""

import json

import torch

import horovod_zero.torch as hvd
from harness import launch


def _with_timeline():
    hvd.init()
    hvd.grouped_allreduce([torch.ones(4), torch.ones(5)], name="traced")
    hvd.allgather(torch.ones(2, 2), name="traced_gather")
    hvd.shutdown()


def test_timeline_is_valid_json_with_phase_spans(tmp_path):
    path = tmp_path / "timeline.json"
    res = launch(_with_timeline, 2, env={"HOROVOD_TIMELINE": str(path)}, timeout=60)
    assert all(s == "ok" for s, _ in res.values()), res
    events = json.loads(path.read_text())  # rank 0 writes it, as in Horovod: the coordinator's view
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
