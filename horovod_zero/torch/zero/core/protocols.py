"""What the parts of the ZeRO optimizer need from each other, as typing.Protocols.
Each collaborator is given to its user's constructor; nothing sets a part's fields
after it is built. Two implementations of each: the device's (core/) and offload's
(offload/)."""

from typing import Callable, ContextManager, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch

from horovod_zero.torch.zero.core.gather import ParamGatherer
from horovod_zero.torch.zero.core.plan import ParamShard


class GradSink(Protocol):
    """Where GradReducer puts each parameter's reduced gradient shard(s): the fp32
    master shard's .grad (core/step.py), or the host (offload/host.py, overlap.py)."""

    takes_early: bool    # hand a shard over as soon as its one reduction is done, during backward
    one_reduction: bool  # refuse a second reduction of a shard in one step
    # takes_early on a CUDA stream of its own (overlap_step on the device): a shard is handed over
    # as soon as its reduction is queued on the GPU, with this stream ordered after it, and the
    # rest of the step's reductions are ordered on it too (None: handed over once done).
    early_stream: Optional["torch.cuda.Stream"]
    # Takes the single reductions of a step by defer(items, order) at finish(), before the GPU
    # is ordered after them: each (s, out) may be read only after order([s.index]) on the
    # stream that reads it (core/step.py MasterGrads; the step in chunks).
    defers: bool

    def begin(self) -> None:
        """A gradient of this step is ready (backward has begun)."""

    def sums(self, s: ParamShard) -> bool:
        """Whether shard s is reduced as a Sum whose 1/size the sink applies itself, in a
        multiply it makes anyway, instead of the runtime's Average ([Note: the mean in the
        step's multiply] in core/step.py). The same answer for every reduction of s until
        the sink takes them."""

    def set_unscale(self, factor: float) -> None:
        """The factor (loss-scale unscaling) this step's gradients are used with."""

    def take_grad(self, s: ParamShard, outs: List[torch.Tensor], early: bool, local: bool = False) -> None:
        """Shard s's reductions of this step are done: `outs` are their outputs."""

    def take_grads(self, items: List[Tuple[ParamShard, List[torch.Tensor], bool]]) -> None:
        """take_grad(s, outs, early=False, local) of each (s, outs, local), at step(): the
        sink may batch their work."""

    def no_grad(self, s: ParamShard) -> None:
        """No rank had a gradient for shard s this step."""


class GatherSource(Protocol):
    """What ParamGatherer allgathers into the parameters: the master shards (cast on
    the way in), or offload's param_dtype copies."""

    in_param_dtype: bool  # the sources are param_dtype already: no cast after the gather
    stream: Optional["torch.cuda.Stream"]  # where sources are copied and gathers enqueued (None: current)

    def before(self, indices: Sequence[int]) -> None:
        """Waits until the values of these shards are there to be read."""

    def inputs(self, items: Sequence[Tuple[int, torch.Tensor]]) -> List[torch.Tensor]:
        """The gather input of each (shard index, its allocated output buffer), on the
        parameters' device."""


class Params(Protocol):
    """How the model's parameters hold the master shards' values between steps: whole
    at stages 1 and 2 (core/params.py), gathered unit by unit at stage 3 (stage3/)."""

    hooks: list

    def on_new_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Parameters were sharded (construction, add_param_group)."""

    def forward_checks(self) -> Iterable[int]:
        """The shards whose storage the model's forward pre-hook checks."""

    def check_at_rest(self) -> None:
        """Refuses a step() while parameters are still in use by a forward."""

    def drop_values(self) -> None:
        """Just before the inner step on the device: the parameters' values may be freed,
        since publish() replaces them."""

    def publish(self, wait: bool, indices: Optional[Sequence[int]] = None) -> None:
        """The master shards at `indices` (all when None) changed: make the parameters
        follow."""

    def free(self) -> None:
        """zero_grad(): drop whatever a forward left gathered."""

    def gathered(self, rank0_only: bool) -> ContextManager:
        """Every parameter whole for the block."""


class StepStrategy(Protocol):
    """What differs between the step on the device and the step on the host (CPU and
    NVMe offload): where reduced gradients go (its sink), what is gathered into the
    parameters (its gatherer, built on its GatherSource), refusals, the overflow check,
    the norm and clipping, the step, and when the new values reach the parameters
    (through the Params policy it is given)."""

    sink: GradSink
    gatherer: ParamGatherer
    state_on_disk: bool  # NVMe offload: the masters and optimizer state live in files

    def add_shards(self, shards: Sequence[ParamShard], stores: Sequence[torch.Tensor]) -> None: ...
    def check_add_group(self) -> None: ...
    def check_step(self, closure) -> None: ...
    def check_clip(self) -> None: ...
    def found_inf(self) -> bool: ...
    def clip(self, max_norm: float, order_after: Callable[[int], None]) -> torch.Tensor: ...
    def step(self, closure, params: Params, overlap: bool): ...
    def skip(self) -> None: ...
    def refresh(self) -> None: ...
    def params_ready(self, indices: Optional[Sequence[int]]) -> None: ...
    def before_update(self) -> None: ...
    def forward_wait(self, indices: Sequence[int]) -> None: ...
    def check_skip(self) -> None: ...
    def check_between_steps(self) -> None: ...
    def materialized(self, write_back: bool) -> ContextManager: ...
    def clear(self) -> None: ...
    def stats(self) -> dict: ...
