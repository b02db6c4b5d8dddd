"""The optimizer's side of offload: wires HostOffload (and overlap_step's worker)
into the gradient reducer and the gatherer, and runs the host step."""

import contextlib
import weakref

from horovod_zero.torch.zero.offload.host import HostOffload
from horovod_zero.torch.zero.offload.overlap import OverlapSink
from horovod_zero.torch.zero.offload.stepper import make_stepper


# About 6 ms of the C++ step on 16 cores: long enough that a chunk's gather is one
# large collective, short enough that little of the copy back waits for the last one.
_CHUNK_NUMEL = 32 << 20


class Offload:
    def __init__(self, options, storage, optimizer, reducer, gatherer, log):
        self._st = storage
        self.nvme = None
        if options.optimizer == "nvme":
            from horovod_zero.torch.zero.offload.nvme_state import NvmeState
            self.nvme = NvmeState(options.nvme_path, storage, optimizer)
        stepper = self.nvme if self.nvme is not None else make_stepper(optimizer, log)
        self.host = HostOffload(storage, stepper, options.params)
        if options.overlap_step and not self.host.stepper.fast:
            raise ValueError(f"overlap_step=True needs torch.optim.Adam or AdamW, which the C++ CPU Adam steps; "
                             f"{type(optimizer).__name__} is stepped by torch after backward. Use overlap_step=False.")
        self.sink = OverlapSink(self.host) if options.overlap_step else None
        if self.sink is not None:
            # The worker thread holds the sink (and so the host shards) until told to end.
            weakref.finalize(self, self.sink.close)
        # overlap_param_gather: shards stepped (or queued) whose new values the parameters do
        # not hold yet; the forward hook of the module that owns one waits for it.
        self.deferred = set()
        if options.overlap_param_gather:
            self.sink.position = {}  # filled as forward waits: the worker takes shards in that order
            self.sink.on_take = self._check_waited
            if storage.sharded_params:
                gatherer.before = self.before_gather  # stage 3: every gather waits for its shards
            elif storage.size > 1:
                self.sink.gather = gatherer.gather
        reducer.sink = self.sink if self.sink is not None else self.host
        gatherer.source = self.host.source
        gatherer.source_stream = self.host.gather_stream

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
        """What step() refuses before it takes this step's gradients."""
        if closure is not None:
            raise ValueError("step(closure) with offload: the step runs on host shards; call the closure "
                             "(forward and backward) before step().")
        if self.sink is not None:
            self.sink.check_hyper()

    def step(self, indices, gather=None):
        """Steps the host shards at `indices` (those overlap_step has not stepped already).
        `gather` (stages 1 and 2) enqueues the gathers of given shards: it is called chunk by
        chunk, so that each chunk's copy to the device and allgather run while the CPU steps
        the next one. Every rank makes the same chunks and calls, whatever it stepped early."""
        early = set()
        if self.sink is not None:
            self.sink.wait()
            early = self.sink.stepped
        for chunk in self._chunks(list(indices)):
            rest = [i for i in chunk if i not in early]
            self.host.step(rest)
            if self._st.sharded_params:
                self.host.publish(rest)  # the device copy at rest (stage 3 without offload_params)
            elif gather is not None:
                gather(chunk)
        self.clear_step()

    def step_deferred(self, indices):
        """overlap_param_gather: queues the shards not stepped early and returns; the worker
        steps them in the order the next forward needs them, while it runs (params_ready)."""
        self.sink.defer(indices)
        self.deferred |= self.sink.stepped
        self.clear_step()

    def params_ready(self, indices):
        """Waits until the deferred shards at `indices` (all when None) are stepped, and
        at stage 2 their allgathers queued (by the worker); the current stream waits for
        their copies back. Called by the forward hooks, stage 3's gathers and
        wait_for_params()."""
        ready = [i for i in (self.deferred if indices is None else indices) if i in self.deferred]
        if not ready:
            return
        for i in ready:
            self.sink.position.setdefault(i, len(self.sink.position))
        self.sink.wait_ready(ready)
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

    def check_skip(self):
        """zero_grad() between backward and step(): the step cannot be skipped once the host
        step of some shards ran during backward."""
        # Refused whenever backward began, not only where a shard was stepped: that depends on
        # each rank's timing, and the ranks must agree.
        if self.sink is not None and self.sink.began:
            raise RuntimeError(
                "zero_grad() after backward with overlap_step=True: the host step of each parameter shard "
                "starts during backward, so this step cannot be skipped. Call step() to complete it, or use "
                "overlap_step=False to decide after backward whether to step.")

    def check_between_steps(self):
        """The whole state read or loaded (state_dict(), checkpoints, export): refused between
        backward and step() with overlap_step, where the host step of this step's shards has
        begun and not ended, so the state would mix two steps (on every rank alike, as
        check_skip)."""
        if self.sink is not None and self.sink.began:
            raise RuntimeError(
                "The optimizer's state was read or loaded (state_dict(), load_state_dict(), a checkpoint or an "
                "export) between backward and step() with overlap_step=True: the host step of this step's "
                "parameter shards began during backward, so the state would mix two steps. Do it after step().")

    def before_gather(self, indices):
        """Stage 3: a gather's sources are the host step's output (copied in by the gather
        with offload_params, or published to the device copy at rest)."""
        if self.deferred:
            self.params_ready(indices)

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

    def check_clip(self):
        if self.sink is not None:
            raise RuntimeError("clip_grad_norm_ with overlap_step=True: the host step runs during backward, before "
                               "the global norm is known. Use overlap_step=False to clip.")

    def clip(self, max_norm):
        total = self.host.norm()
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            self.host.scale *= coef
        return total.float()

    def skip(self):
        """A step skipped (overflow): nothing was stepped early (overlap_step refuses loss scaling)."""
        self.clear_step()

    def clear_step(self):
        if self.sink is not None:
            self.sink.clear()

    def clear(self):
        self.clear_step()
        self.host.clear()

    def stats(self):
        out = dict(self.host.stats)
        if self.nvme is not None:
            out.update(self.nvme.stats())
        out["step"] = self.host.stepper.describe()
        return out
