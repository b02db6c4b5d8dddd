"""The step on the host (offload_optimizer="cpu" or "nvme"): the StepStrategy
(core/protocols.py) whose sink copies reduced gradient shards to the host (host.py;
overlap.py steps them there during backward with overlap_step=True), whose step is
the C++ CPU Adam or torch on the host shards, and whose gathers read the host step's
param_dtype output."""

import contextlib
import weakref

from horovod_zero.torch.zero.core import norms
from horovod_zero.torch.zero.core.gather import ParamGatherer
from horovod_zero.torch.zero.core.params import wait_for_params
from horovod_zero.torch.zero.offload.host import HostOffload
from horovod_zero.torch.zero.offload.nvme_state import NvmeState
from horovod_zero.torch.zero.offload.overlap import OverlapSink
from horovod_zero.torch.zero.offload.stepper import make_stepper

# About 6 ms of the C++ step on 16 cores: long enough that a chunk's gather is one
# large collective, short enough that little of the copy back waits for the last one.
_CHUNK_NUMEL = 32 << 20


class HostSource:
    """GatherSource: the host step's param_dtype output, on the device (host.py
    HostOffload.source). `ready` (stage 3 with overlap_param_gather): waits for the
    deferred host step of the shards a gather reads."""

    in_param_dtype = True

    def __init__(self, host, ready=None):
        self._host = host
        self._ready = ready
        # Gathers copy host values in and enqueue their collectives on a side stream, so that a
        # copy runs beside the compute it prefetches for instead of in its queue.
        self.stream = host.gather_stream

    def before(self, indices):
        if self._ready is not None:
            self._ready(indices)

    def inputs(self, items):
        return [self._host.source(i, store) for i, store in items]


class HostStep:
    def __init__(self, options, storage, optimizer, downcast, log):
        self._st = storage
        self._optimizer = optimizer
        self.nvme = NvmeState(options.nvme_path, storage, optimizer) if options.offload_optimizer == "nvme" else None
        stepper = self.nvme if self.nvme is not None else make_stepper(optimizer, log)
        self.host = HostOffload(storage, stepper, options.offload_params)
        if options.overlap_step and not stepper.fast:
            raise ValueError(f"overlap_step=True needs torch.optim.Adam or AdamW, which the C++ CPU Adam steps; "
                             f"{type(optimizer).__name__} is stepped by torch after backward. Use overlap_step=False.")
        track = options.overlap_param_gather
        # The sink's worker and the gatherer may each need the other; in one configuration
        # only one of them does, so it is built second.
        self._overlap = None
        if not options.overlap_step:
            self.sink = self.host
            self.gatherer = ParamGatherer(storage, HostSource(self.host), downcast)
        elif storage.sharded_params:  # stage 3: every gather waits for the host step of its shards
            self.sink = self._overlap = OverlapSink(self.host, track_forward=track)
            ready = self._overlap.params_ready if track else None
            self.gatherer = ParamGatherer(storage, HostSource(self.host, ready), downcast)
        else:  # stages 1 and 2: the worker gathers the shards it stepped
            self.gatherer = ParamGatherer(storage, HostSource(self.host), downcast)
            gather = self.gatherer.gather if track and storage.size > 1 else None
            self.sink = self._overlap = OverlapSink(self.host, track_forward=track, gather=gather)
        if self._overlap is not None:
            # The worker thread holds the sink (and so the host shards) until told to end.
            weakref.finalize(self, self._overlap.close)

    @property
    def state_on_disk(self):
        return self.nvme is not None

    def add_shards(self, shards, stores):
        self.host.add_shards(shards, stores)  # the param_dtype copies, from the masters
        if self.nvme is not None:
            self.nvme.add_shards(shards)  # then the masters go to disk

    def check_add_group(self):
        if self.nvme is not None and self._st.shards:
            raise ValueError("add_param_group() with offload_optimizer='nvme': the state files are laid out at "
                             "construction. Put every param group in the optimizer before wrapping it.")

    def materialized(self, write_back):
        """The whole master and optimizer state in host memory for the block (NVMe), written
        back after it if write_back; without NVMe it always is."""
        return self.nvme.materialized(write_back) if self.nvme is not None else contextlib.nullcontext()

    def check_step(self, closure):
        """What step() refuses before it takes this step's gradients: a call refused here
        changes nothing, so it can be called again once the cause is put right."""
        if closure is not None:
            raise ValueError("step(closure) with offload: the step runs on host shards; call the closure "
                             "(forward and backward) before step().")
        if self._overlap is not None:
            self._overlap.check_hyper()

    def check_clip(self):
        if self._overlap is not None:
            raise RuntimeError("clip_grad_norm_ with overlap_step=True: the host step runs during backward, before "
                               "the global norm is known. Use overlap_step=False to clip.")

    def found_inf(self):
        return norms.found_inf(self.host.present_grads(), self._st.groups.scope.process_set, "cpu",
                               tag=self._st.groups.tag)

    def clip(self, max_norm, order_after):
        # The host gradients are never rewritten: unscaling and clipping are one factor the step applies.
        total = norms.global_norm(self.host.present_grads(), self._st.groups.shard_set, "cpu", self.host.scale,
                                  tag=self._st.groups.tag)
        coef = norms.clip_coef(total, max_norm)
        if coef < 1.0:
            self.host.scale *= coef
        return total.float()

    def step(self, closure, params, overlap):
        every = range(len(self._st.shards))
        if overlap:
            self._overlap.defer_step(every)  # each unit's forward (stage 3: each gather) waits for its own
        elif self._st.sharded_params:
            self._step_chunks(every)
        else:
            self._step_chunks(every, gather=self.gatherer.gather)
            wait_for_params(self, self.gatherer)
        if self.host.stepper.fast:
            # The C++ Adam stepped the shards and no master has a .grad, so this steps nothing;
            # it is called so that LR schedulers and step hooks see one step() per step.
            self._optimizer.step()
        if self._st.sharded_params:
            params.publish(wait=False)  # the next forward gathers the new values
        return None

    def _step_chunks(self, indices, gather=None):
        """Steps the host shards at `indices` (those overlap_step has not stepped already).
        `gather` (stages 1 and 2) enqueues the gathers of given shards: it is called chunk by
        chunk, so that each chunk's copy to the device and allgather run while the CPU steps
        the next one. Every rank makes the same chunks and calls, whatever it stepped early."""
        early = set()
        if self._overlap is not None:
            self._overlap.wait()
            early = self._overlap.stepped
        for chunk in self._chunks(list(indices)):
            rest = [i for i in chunk if i not in early]
            self.host.step(rest)
            if self._st.sharded_params:
                self.host.publish(rest)  # the device copy at rest (stage 3 without offload_params)
            elif gather is not None:
                gather(chunk)
        self._clear_step()

    def _chunks(self, indices):
        if self.nvme is not None:  # its step streams the state file in its own sub-groups
            return [indices]
        chunks, numel = [[]], 0
        for i in indices:
            if numel >= _CHUNK_NUMEL:
                chunks.append([])
                numel = 0
            chunks[-1].append(i)
            numel += self._st.shards[i].shard
        return chunks

    def skip(self):
        """A step skipped (overflow): nothing was stepped early (overlap_step refuses loss scaling)."""
        self._clear_step()

    def refresh(self):
        """After a load: the param_dtype copies made again from the masters."""
        self.host.refresh(range(len(self._st.shards)))

    def before_update(self):
        wait_for_params(self, self.gatherer)  # the host steps the masters the gathers read

    def params_ready(self, indices):
        if self._overlap is not None and self._overlap.deferred:  # the host step's end
            self._overlap.params_ready(indices)

    def forward_wait(self, indices):
        """overlap_param_gather at stages 1 and 2: a unit's forward waits for its shards to be
        stepped, copied back and (by the worker) gathered."""
        self._overlap.params_ready(indices)
        self.gatherer.wait(indices, stream_ordered=True)  # released by the next wait_for_params()

    def check_skip(self):
        """zero_grad() between backward and step(): the step cannot be skipped once the host
        step of some shards ran during backward."""
        self._refuse_after_backward(
            "zero_grad() after backward with overlap_step=True: the host step of each parameter shard "
            "starts during backward, so this step cannot be skipped. Call step() to complete it, or use "
            "overlap_step=False to decide after backward whether to step.")

    def check_between_steps(self):
        """The whole state read or loaded (state_dict(), checkpoints, export): refused between
        backward and step() with overlap_step, where the host step of this step's shards has
        begun and not ended, so the state would mix two steps."""
        self._refuse_after_backward(
            "The optimizer's state was read or loaded (state_dict(), load_state_dict(), a checkpoint or an "
            "export) between backward and step() with overlap_step=True: the host step of this step's "
            "parameter shards began during backward, so the state would mix two steps. Do it after step().")

    def _refuse_after_backward(self, message):
        # Refused whenever backward began, not only where a shard was stepped: that depends on
        # each rank's timing, and the ranks must agree.
        if self._overlap is not None and self._overlap.began:
            raise RuntimeError(message)

    def _clear_step(self):
        if self._overlap is not None:
            self._overlap.clear()

    def clear(self):
        self._clear_step()
        self.host.clear()

    def stats(self):
        out = dict(self.host.stats)
        if self.nvme is not None:
            out.update(self.nvme.stats())
        out["step"] = self.host.stepper.describe()
        return out
