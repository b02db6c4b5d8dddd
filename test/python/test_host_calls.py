"""examples/host_calls.py: the per-step host time of chosen functions (profile_host.py
HVDZ_TIME_CALLS=1) counts every call, inclusive of the calls it makes, and still returns
what the function returns."""

import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import host_calls  # noqa: E402


class Worker:
    def inner(self, x):
        time.sleep(0.002)
        return x + 1

    def outer(self, x):
        return self.inner(x) * 2


def test_methods_and_module_functions_are_counted_inclusive_of_their_callees():
    mod = types.ModuleType("pkg.helpers")
    mod.twice = lambda f, x: f(f(x))
    timer = host_calls.CallTimer()
    timer.instrument_class(Worker)
    timer.instrument_functions(mod, ("twice",))
    w = Worker()
    assert mod.twice(w.outer, 1) == 10  # (1 + 1) * 2 = 4, then (4 + 1) * 2
    assert timer.calls == {"Worker.outer": 2, "Worker.inner": 2, "helpers.twice": 1}
    assert timer.total["helpers.twice"] >= timer.total["Worker.outer"] >= timer.total["Worker.inner"] >= 0.004
    rows = timer.table(steps=2).splitlines()
    assert rows[0].endswith("helpers.twice") and "1.0 calls" in rows[1]
    timer.reset()
    assert not timer.calls and not timer.total
