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

import contextlib
import os
import threading

import torch

from horovod_zero import settings
from horovod_zero.torch.zero.core import hyper
from horovod_zero.torch.zero.offload.host import HostOffload


# About 6 ms of the host step on 16 cores, as the step's chunks (host_step.py).
_BATCH_NUMEL = 32 << 20


def backward_threads(env=None):
    """Threads of the host step beside backward (HOROVOD_ZERO_OVERLAP_STEP_THREADS): by
    default all usable cores but two, which stay for the threads that launch backward's
    kernels and run the collectives; with every core spinning in the step, those are
    descheduled and the GPU waits."""
    n = settings.read_section("cpu_adam", env)["overlap_step_threads"]
    return n if n > 0 else max(1, len(os.sched_getaffinity(0)) - 2)


class OverlapSink:
    """The GradReducer's sink (core/protocols.py GradSink) with overlap_step=True:
    HostOffload plus the worker.

    `track_forward` (overlap_param_gather): step() returns before the host step ends; the
    shards it queued are `deferred` until a forward needs them (params_ready()), the
    worker takes them in the order forwards ask, and a gradient of a shard no forward
    waited for is refused. `gather` (overlap_param_gather at stages 1 and 2 on more than
    one rank): enqueues the allgathers of stepped shards; the worker calls it, so that
    every rank gathers every shard it stepped whatever its forward runs (ranks whose
    forwards differ would wait for each other)."""

    defers = False  # GradSink.defers
    takes_early = True
    one_reduction = True  # GradReducer refuses a second reduction of a shard in one step
    early_stream = None

    def __init__(self, host: HostOffload, track_forward=False, gather=None):
        self.host = host
        self._lock = threading.Condition()
        # Queued shards: index -> (event, host gradient, hyperparameters, sequence number).
        self._queue, self._seq, self._closing = {}, 0, False
        self._pending = set()  # queued or being stepped: their host gradients are in use
        self._ready = {}       # stepped shards whose values are on their way back -> copy's event
        self._error = None
        self._thread = None
        # The hyperparameters of this step's shards (stepper.snapshot()), from backward's first
        # gradient until step() (defer() or clear()); their identity tells this step's shards.
        self._hyper = None
        self.stepped = set()   # shard indices stepped early this step
        # Forward order (overlap_param_gather): index -> position, filled as forwards wait.
        # The worker takes the shards the next forward needs first; without it, in the
        # order they came.
        self.position = {} if track_forward else None
        self._track_forward = track_forward
        self.gather = gather
        # Shards stepped (or queued) whose new values the parameters do not hold yet; the
        # forward that needs one waits for it (params_ready).
        self.deferred = set()
        # Until step() (defer()), the worker holds the gathers of what it stepped early for this
        # step: a rank steps a shard early only where it had a gradient, the others at their
        # step(), and a rank waiting in step() for an allgather another rank enqueues only at
        # its own would hang. Only this step's (hyperparameters `_hyper`): a shard deferred by
        # the last step() and stepped after this backward began is owed to ranks whose forward
        # waits for it now, and holding it hangs them (a rank whose forward skipped its module).
        self._held = []
        self.threads = backward_threads()
        host.stats["stepped_before_step"] = 0

    # --- the GradReducer's side -----------------------------------------------

    def sums(self, s):
        return False  # the runtime averages: no multiply of this sink's to fold the mean into

    def set_unscale(self, factor):
        self.host.set_unscale(factor)

    def take_grad(self, s, outs, early, local=False):
        if (early or local) and self._track_forward:  # a gradient of this rank's forward
            self._check_waited(s)
        # The previous step's shard may still be queued (overlap_param_gather: the forward
        # that needs it waits for it; nothing else does): its host gradient is in use.
        self.wait_ready([s.index], stream=False)
        self.host.take_grad(s, outs)
        if early:  # after begin(): the reducer calls it at every gradient
            self.stepped.add(s.index)
            self._submit([s.index])

    def begin(self):
        """Backward has begun (GradReducer, at each gradient): the hyperparameters every shard
        of this step is stepped with are taken now, on every rank at the same point, so that
        a change before step() is refused on all of them, however far each worker got."""
        if self._hyper is None:
            snapshot = self.host.stepper.snapshot()
            with self._lock:
                self._hyper = snapshot

    @property
    def began(self):
        """Whether backward has begun since the last step(), on every rank alike."""
        return self._hyper is not None

    def take_grads(self, items):
        for s, outs, local in items:
            self.take_grad(s, outs, early=False, local=local)

    def no_grad(self, s):
        self.host.no_grad(s)

    def _submit(self, indices):
        # Every shard is queued as part of a begun step, also where no backward hook ran
        # (gradients set as p.grad = g): its gather is then held as this step's.
        self.begin()
        ev = None
        if self.host.h2d_stream is not None:
            ev = torch.cuda.Event()
            ev.record()  # the compute stream: every use of these parameters in backward is before this
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdz-offload-step", daemon=True)
                self._thread.start()
            for i in indices:
                self._queue[i] = (ev, self.host.grads.get(i), self._hyper, self._seq)
                self._pending.add(i)
                self._seq += 1
            self._lock.notify_all()

    # --- the worker ---------------------------------------------------------------

    def _run(self):
        while True:
            batch, published = {}, None
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if not self._queue:
                    return  # close(): ends once every queued shard is stepped
                try:
                    batch = self._take_batch()
                except BaseException as e:  # noqa: BLE001 - reported on the training thread
                    self._error = self._error or e
                    batch, self._queue = dict(self._queue), {}
            try:
                if self._error is None:
                    published = self._step(batch)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread by every wait
                self._error = e
            with self._lock:
                for i in batch:
                    self._pending.discard(i)
                    self._ready[i] = published
                self._lock.notify_all()

    def _take_batch(self):
        """Up to _BATCH_NUMEL elements (at least one shard) of the queue, first in forward
        order when it is known, else in the order they came: a batch's values go back to
        the device when all of it is stepped, so a large backlog is cut into batches whose
        copies run while the next is stepped. Returns index -> queue entry."""
        shards = self.host.shards
        order = sorted(self._queue, key=lambda i: self._queue[i][3])
        if self.position is not None:
            order.sort(key=lambda i: self.position.get(i, len(shards)))
        batch, numel = {}, 0
        hyper = self._queue[order[0]][2]
        for i in order:
            if batch and numel + shards[i].shard > _BATCH_NUMEL:
                break
            if self._queue[i][2] is not hyper:
                continue  # another step's shard (one not needed by the forward between): its own batch
            numel += shards[i].shard
            batch[i] = self._queue.pop(i)
        return batch

    def _step(self, batch):
        """Steps the batch and starts its copy back: returns that copy's event (None on the CPU)."""
        indices = list(batch)
        hyper = next(iter(batch.values()))[2]  # one step's shards (_take_batch): one snapshot
        self.host.step(indices, threads=self.threads, grads={i: e[1] for i, e in batch.items()}, hyper=hyper)
        last = max(batch.values(), key=lambda e: e[3])[0]
        if last is None:
            self.host.publish(indices)
            self._gather_or_hold(indices, hyper)
            return None
        stream = self.host.h2d_stream
        stream.wait_event(last)  # recorded in order on the compute stream: covers the others
        with torch.cuda.stream(stream):
            self.host.publish(indices)
            done = torch.cuda.Event()
            done.record()
            self._gather_or_hold(indices, hyper)  # its sources are the copies just queued on this stream
        return done

    def _gather_or_hold(self, indices, hyper):
        if self.gather is None:
            return
        with self._lock:
            hold = hyper is self._hyper
            if hold:
                self._held += indices
        if not hold:
            self.gather(indices)

    # --- the training thread's side -------------------------------------------------

    def check_hyper(self):
        """Refuses a step whose shards were stepped early with other hyperparameters than
        the param groups hold now: the learning rate was changed after backward began."""
        if self._hyper is not None:
            hyper.check_unchanged(self._hyper, self.host.stepper.snapshot())

    def defer(self, indices):
        """Queues the shards at `indices` that have a gradient and were not stepped early
        (overlap_param_gather: step() returns before they are stepped)."""
        with self._lock:
            self.host.stats["stepped_before_step"] += len(self._ready)  # as wait() counts them
        rest = [i for i in indices if i not in self.stepped and self.host.grads.get(i) is not None]
        self.stepped.update(rest)
        if rest:
            self._submit(rest)
        with self._lock:
            self._hyper = None  # this step's gathers are held no longer
            held, self._held = self._held, []  # each once: a shard is reduced once a step
        if held:  # stepped early: their copies back are queued on the side stream already
            stream = self.host.h2d_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.gather(held)

    def defer_step(self, indices):
        """overlap_param_gather: queues the shards not stepped early and returns; the worker
        steps them in the order the next forward needs them, while it runs (params_ready)."""
        self.defer(indices)
        self.deferred |= self.stepped
        self.clear()

    def params_ready(self, indices):
        """Waits until the deferred shards at `indices` (all when None) are stepped, and
        at stage 2 their allgathers queued (by the worker); the current stream waits for
        their copies back. Called by the forward hooks, stage 3's gathers and
        wait_for_params()."""
        ready = [i for i in (self.deferred if indices is None else indices) if i in self.deferred]
        if not ready:
            return
        for i in ready:
            self.position.setdefault(i, len(self.position))
        self.wait_ready(ready)
        self.deferred.difference_update(ready)

    def _check_waited(self, s):
        """A gradient for a shard whose new values no forward waited for: the forward read
        it stale (outside the module that holds it), and this step would be wrong."""
        if s.index in self.deferred:
            raise RuntimeError(
                f"Parameter '{s.name}' got a gradient from a forward that read it before its last update was in "
                "place: with overlap_param_gather=True a parameter is waited for by the forward of the unit (or "
                "the model) that holds it, and it was used outside that forward. Call opt.wait_for_params() "
                "before such a forward, pass units= that hold it, or use overlap_param_gather=False.")

    def wait_ready(self, indices, stream=True):
        """Waits until the shards at `indices` that are queued or being stepped are stepped,
        and (stream=True) orders the current stream after their copies back."""
        with self._lock:
            while any(i in self._pending for i in indices):
                self._lock.wait()
            events = {self._ready.pop(i, None) for i in indices} if stream else set()
        for ev in events - {None}:
            torch.cuda.current_stream().wait_event(ev)
        self._raise()

    def wait(self):
        """Waits until every queued shard is stepped and on its way back; the current
        stream waits for the copies."""
        with torch.profiler.record_function("hvd_zero.offload.wait_early_steps"):
            with self._lock:
                # The evidence of overlap: shards whose host step was done when step() came.
                self.host.stats["stepped_before_step"] += len(self._ready)
                everything = self._pending | set(self._ready)  # only this thread queues more
            self.wait_ready(everything)

    def _raise(self):
        # Every later wait raises too: the shards after the failure were not stepped.
        if self._error is not None:
            raise RuntimeError(f"The offloaded optimizer step failed on its worker thread: {self._error}. Shards "
                               "stepped before it kept their update and the rest did not: restore the model and "
                               "optimizer from a checkpoint.") from self._error

    def clear(self):
        self.stepped.clear()
        self._hyper = None

    def close(self):
        with self._lock:
            self._closing = True
            self._lock.notify_all()
