"""Inclusive host time and call count of chosen Python functions, per step: wraps every
function of the given classes and the named functions of the given modules. Used by
profile_host.py (HVDZ_TIME_CALLS=1); the wrappers cost about a microsecond a call, so
read the table for where the time goes, not for the step's total."""
import collections
import functools
import inspect
import time


class CallTimer:
    def __init__(self):
        self.total = collections.defaultdict(float)
        self.calls = collections.Counter()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t
                self.calls[name] += 1
        return timed

    def instrument_class(self, cls):
        for attr, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and not attr.startswith("__"):
                setattr(cls, attr, self._wrap(f"{cls.__name__}.{attr}", fn))

    def instrument_functions(self, module, names):
        for attr in names:
            setattr(module, attr, self._wrap(f"{module.__name__.rsplit('.', 1)[-1]}.{attr}", getattr(module, attr)))

    def reset(self):
        self.total.clear()
        self.calls.clear()

    def table(self, steps, top=40):
        rows = sorted(self.total.items(), key=lambda kv: -kv[1])[:top]
        return "\n".join(f"  {t / steps * 1e3:8.2f} ms {self.calls[n] / steps:7.1f} calls  {n}" for n, t in rows)


def instrument_zero():
    """A CallTimer over the ZeRO package's per-step paths (call before building the optimizer)."""
    from horovod_zero.torch import enqueue
    from horovod_zero.torch.zero import optimizer
    from horovod_zero.torch.zero.core import gather, master_adam, params, reduce, step, step_chunks, storage
    from horovod_zero.torch.zero.stage3 import hooks

    timer = CallTimer()
    for cls in (hooks.Stage3, gather.ParamGatherer, storage.ShardedStorage, reduce.GradReducer, step.MasterGrads,
                step.DeviceStep, step_chunks.ChunkedStep, params.WholeParams, optimizer.DistributedZeroOptimizer):
        timer.instrument_class(cls)
    timer.instrument_functions(enqueue, ("_enqueue", "_wait_stream", "synchronize", "poll", "_try_let_go",
                                         "_try_wait_stream"))
    timer.instrument_functions(hooks, ("_through",))
    timer.instrument_functions(master_adam, ("step",))
    return timer
