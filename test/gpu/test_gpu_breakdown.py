"""examples/step_breakdown.py on a real CUDA profile: a matmul is compute, a foreach
update inside the optimizer mark is the optimizer's, and the parts add up to the GPU's
busy time, which a step that waits on the host leaves short of its wall time."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import step_breakdown as sb  # noqa: E402

pytestmark = pytest.mark.gpu


def test_a_real_profile_splits_into_compute_optimizer_and_idle():
    a = torch.randn(4096, 4096, device="cuda")
    params = [torch.zeros(1 << 20, device="cuda") for _ in range(8)]

    def step():
        a @ a
        time.sleep(0.01)  # the host holds the GPU up: idle, not any kernel's time
        with torch.profiler.record_function(sb.OPTIMIZER_MARK):
            torch._foreach_add_(params, 1.0)
    step()
    parts = sb.profile_parts(step, 3, torch.cuda.synchronize)
    assert parts["compute"] > 0 and parts["optimizer"] > 0, parts
    assert parts["exposed"] == 0 and parts["hidden"] == 0, parts
    assert parts["idle"] > 0.005, parts  # the sleep, between the matmul and the update
    assert sb.busy(parts) < 0.01, parts
