"""Stages 1 and 2: every parameter is whole on every rank. After a step the new
master shards are allgathered into the parameters' buffers; with
overlap_param_gather=True step() returns once the gathers are queued, and each gather
unit's forward (and the model's, for what no unit holds) waits for its own
parameters first, so that later layers' gathers run under earlier layers' compute.
Stage 3's Params is stage3/hooks.py."""

from horovod_zero.torch.zero.core.units import assign
from horovod_zero.torch.zero.core.weak import weak_hook


def wait_for_params(step, gatherer, indices=None):
    """Waits until the parameters hold the values of the last step (all of them, or the
    shards at `indices`): the step strategy's deferred host step, then the gathers,
    released (stage 3: also those the compute stream only waited for)."""
    step.params_ready(indices)
    gatherer.wait(indices)
    gatherer.release(indices)


class WholeParams:
    def __init__(self, model, storage, gatherer, step, wait_units):
        """`wait_units`: with overlap_param_gather, the modules whose forward waits for
        their parameters (core/units.py wait_units); None without it."""
        self._model = model
        self._st = storage
        self._gatherer = gatherer
        self._step = step  # the StepStrategy: its forward_wait() waits for a unit's parameters
        self._wait_units = wait_units
        self.hooks = []

    def on_new_params(self, params):
        if self._wait_units is None:
            return
        # A module may read a child's weights without calling it (MultiheadAttention reads
        # out_proj's), so a unit waits for every parameter of its subtree; see units.py.
        per_unit, root = assign(self._model, self._wait_units, self._st.shard_of)
        ours = {self._st.shard_of[p].index for p in params}
        for m, own in [(self._model, root)] + list(zip(self._wait_units, per_unit)):
            own = tuple(i for i in own if i in ours)
            if own:
                self.hooks.append(m.register_forward_pre_hook(weak_hook(self, "_forward_wait", own)))

    def _forward_wait(self, indices, module, args):
        self._step.forward_wait(indices)

    def forward_checks(self):
        # One parameter's storage, O(1) a forward: model.float()/.half()/.to() after wrapping
        # replace every parameter's, and the forward would run on weights that never update.
        return range(min(1, len(self._st.shards)))

    def check_at_rest(self):
        pass

    def drop_values(self):
        """Frees every parameter's storage for the step: it writes only the master shards
        (and, with the master Adam kernel, this rank's slots, allocated again as their chunk
        is stepped), and publish() gathers the new values into the same storage, allocated
        again once the step's temporaries are gone. So the old values are never held beside
        them (FSDP2 frees its unsharded parameters after backward); the update's peak is lower by the
        parameters' size. The parameters keep their shapes and views; reading one before
        publish() fails instead of reading stale values. No gather may be in flight (step()
        has waited for them)."""
        for i in range(len(self._st.shards)):
            self._st.drop(i)

    def publish(self, wait, indices=None):
        """Allgathers the master shards at `indices` (all when None) into the parameters;
        wait=False leaves the handles for wait_for_params() (the forward hooks, or the next
        step). wait=True orders the current stream after every gather in flight: what runs
        on it next reads the new values, and the CPU does not wait for the gathers to run."""
        self._gatherer.gather(range(len(self._st.shards)) if indices is None else indices)
        if wait:
            self._gatherer.wait(stream_ordered=True)

    def free(self):
        pass

    def gathered(self, rank0_only):
        raise ValueError("gathered_params() is for stage=3; at stages 1 and 2 the parameters are always whole.")
