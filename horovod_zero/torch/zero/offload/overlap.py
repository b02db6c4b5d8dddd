"""overlap_step=True: each gradient shard is stepped on the host as soon as it has
arrived there, on a worker thread, while backward goes on; its new param_dtype
values go back to the device on a side stream. step() then only waits for the
worker and gathers.

[Note: stepping inside backward]
- Only the shards this rank had a gradient for, reduced once this step, are
  stepped early: for them the reduced gradient is final and some rank had one, so
  the inner optimizer would step them too. The others wait for step(), which knows
  (after an allreduce) whether any rank had a gradient.
- A shard's gradient is ready only after every use of the parameter in this
  backward, so its new values may overwrite the parameter then: the copy back waits
  for an event recorded on the compute stream when the gradient was taken.
- Whatever needs all gradients before the first update (clipping, loss scaling,
  a second reduction of a shard in the same step) is refused, not approximated:
  always, not only when a shard happened to be stepped early, so that every rank
  refuses the same call whatever its timing.
- The C++ step releases the GIL, so backward's own Python hooks keep running. The
  worker takes the arrived shards in batches and makes one call of each kind per
  batch: every call that releases the GIL costs a wait to take it back, up to the
  interpreter's switch interval while backward's hooks hold it."""

import os
import threading

import torch

from horovod_zero import settings
from horovod_zero.torch.zero.offload.host import HostOffload


# About 6 ms of the host step on 16 cores, as the step's chunks (engine.py).
_BATCH_NUMEL = 32 << 20


def backward_threads(env=None):
    """Threads of the host step beside backward (HOROVOD_ZERO_OVERLAP_STEP_THREADS): by
    default all usable cores but two, which stay for the threads that launch backward's
    kernels and run the collectives; with every core spinning in the step, those are
    descheduled and the GPU waits."""
    n = settings.read_section("cpu_adam", env)["overlap_step_threads"]
    return n if n > 0 else max(1, len(os.sched_getaffinity(0)) - 2)


class OverlapSink:
    """The GradReducer's sink with overlap_step=True: HostOffload plus the worker."""

    def __init__(self, host: HostOffload):
        self.host = host
        self._lock = threading.Condition()
        self._queue, self._submitted, self._finished, self._counted = [], 0, 0, 0
        self._error = None
        self._thread = None
        self.stepped = set()   # shard indices stepped early this step
        self._published = []   # events of the copies back to the device
        self.threads = backward_threads()
        host.stats["stepped_before_step"] = 0

    @property
    def scale(self):
        return self.host.scale

    @scale.setter
    def scale(self, value):
        self.host.scale = value

    # --- the GradReducer's side -----------------------------------------------

    one_reduction = True  # GradReducer refuses a second reduction of a shard in one step

    def take_grad(self, s, outs, early):
        self.host.take_grad(s, outs)
        if not early:
            return
        self.stepped.add(s.index)
        ev = torch.cuda.Event() if outs[0].is_cuda else None
        if ev is not None:
            ev.record()  # the compute stream: every use of the parameter in backward is before this
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdz-offload-step", daemon=True)
                self._thread.start()
            self._queue.append((s.index, ev))
            self._submitted += 1
            self._lock.notify_all()

    def no_grad(self, s):
        self.host.no_grad(s)

    # --- the worker ---------------------------------------------------------------

    def _run(self):
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                batch = self._take_batch()
            if None in batch:
                return
            try:
                if self._error is None:
                    self._step(batch)
            except BaseException as e:  # raised on the training thread by wait()
                self._error = e
            with self._lock:
                self._finished += len(batch)
                self._lock.notify_all()

    def _take_batch(self):
        """The queue's head, up to _BATCH_NUMEL elements (at least one shard): a batch's
        values go back to the device when all of it is stepped, so a large backlog is cut
        into batches whose copies run while the next is stepped."""
        shards, numel, n = self.host.shards, 0, 0
        for item in self._queue:
            if item is None or (n and numel + shards[item[0]].shard > _BATCH_NUMEL):
                break  # close()'s None ends the worker once the shards before it are stepped
            numel += shards[item[0]].shard
            n += 1
        n = max(n, 1)
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    def _step(self, batch):
        indices = [i for i, _ in batch]
        self.host.step(indices, threads=self.threads)
        events = [ev for _, ev in batch if ev is not None]
        if not events:
            self.host.publish(indices)
            return
        stream = self.host.h2d_stream
        stream.wait_event(events[-1])  # recorded in order on the compute stream: covers the others
        with torch.cuda.stream(stream):
            self.host.publish(indices)
            done = torch.cuda.Event()
            done.record()
        with self._lock:
            self._published.append(done)

    def wait(self):
        """Waits until every shard stepped early is stepped and on its way back; the
        current stream waits for the copies."""
        with torch.profiler.record_function("hvd_zero.offload.wait_early_steps"), self._lock:
            # The evidence of overlap: shards whose host step was done when step() came.
            self.host.stats["stepped_before_step"] += self._finished - self._counted
            while self._finished < self._submitted:
                self._lock.wait()
            published, self._published = self._published, []
            self._counted = self._finished
        for ev in published:
            torch.cuda.current_stream().wait_event(ev)
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"The offloaded optimizer step failed on its worker thread: {e}") from e

    def clear(self):
        self.stepped.clear()

    def close(self):
        with self._lock:
            if self._thread is not None:
                self._queue.append(None)
                self._lock.notify_all()
