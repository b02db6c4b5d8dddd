"""Hybrid sharding (shard_group="node"): shards within each node, replicas across
nodes, as FSDP2's HSDP and ZeRO++'s hpZ do.

[Note: hybrid sharding]
- The node set holds the ranks of one node (same hvd.cross_rank()); the cross set
  holds the ranks at the same place in every node, which hold the same shards.
- A parameter is split into local_size shards; a rank keeps its node-local shard
  (master, optimizer state: 1/local_size each).
- Gradients: reduce-scatter (Average) in the node set, then an allreduce (Average)
  of each shard in the cross set; with equal nodes that is the average over every
  rank, and only the shards (1/local_size of the gradients) cross nodes. A shard's
  step waits only for its own allreduce, so the shards averaged first are stepped
  while the rest still cross (core/reduce.py GradReducer._take_rest).
- Gathers, stage 3's included, run in the node set: they never leave the node.
- Norms reduce over the node set (each node holds every shard once); checks that
  must agree everywhere (which parameters had a gradient, overflow) stay global.
Both sets are registered by every rank in the same order when the optimizer is built
(process sets are collective), or reused when the job has them already.

Everything hybrid sharding changes is here: ShardGroups, the value the storage,
reducer, gatherer, norms and state code take whole, says which set each collective
runs in, and does the one extra step (average_replicas) and the one difference in
when a reduced shard is final (final_after_reduce_scatter)."""

from dataclasses import dataclass, replace
from typing import Optional

from horovod_zero.torch import basics
from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.basics import _core
from horovod_zero.torch.job import _add
from horovod_zero.torch.objects import agreed_number, allgather_object, reserve_number
from horovod_zero.torch.process_sets import ProcessSet


@dataclass(frozen=True)
class Scope:
    """The ranks an optimizer spans (every rank, or one process set's) and its first
    rank (a job rank): the one that writes checkpoints and roots their broadcasts."""
    process_set: Optional[ProcessSet]  # None: the global set
    root: int

    def is_root(self) -> bool:
        return basics.rank() == self.root


@dataclass(frozen=True)
class ShardGroups:
    rank: int                      # this rank's place among the ranks sharing its shards
    size: int                      # how many ranks one parameter is split over
    shard_set: Optional[ProcessSet]  # None: the global set (full sharding)
    cross_set: Optional[ProcessSet]  # None: no replicas to average over
    scope: Scope = Scope(None, 0)
    # The optimizer's collectives are named <tag>.param.3, <tag>.grad.3.0, ...: "zero" for
    # the first ZeRO optimizer the job builds over every rank, "zero1", "zero2"... for the
    # next ones ("zero@5", "zero1@5"... over process set 5), so that two optimizers'
    # gathers or reductions in flight at once (a GAN's two, say) never share a name: the
    # runtime would refuse the second on the ranks where the first had not run yet, and
    # the others would wait for it. The set is in the tag because optimizers over
    # different sets count apart, yet may gather in the same node set.
    tag: str = "zero"
    tag_number: int = 0  # its place in that count ("zero": 0, "zero1": 1, ...)

    @property
    def final_after_reduce_scatter(self) -> bool:
        """Whether a shard's reduce-scatter output is its final gradient; with replicas it
        is final only after their average (so offload cannot take it during backward)."""
        return self.cross_set is None

    def average_replicas(self, items):
        """`items`: (shard, reduced tensor) pairs; each tensor is averaged in place with its
        replicas on the other nodes, by one grouped allreduce in the cross set. Returns its
        handles, for the caller to wait for."""
        if self.cross_set is None or not items:
            return []
        tensors = [t for _, t in items]
        return ops._enqueue(_core.OP_ALLREDUCE, tensors, tensors, [f"{self.tag}.cross.{s.index}" for s, _ in items],
                            ops.Average, process_set=self.cross_set)


def full_sharding() -> ShardGroups:
    return ShardGroups(basics.rank(), basics.size(), None, None)


def set_sharding(process_set) -> ShardGroups:
    """Full sharding over one registered process set's ranks (process_set=)."""
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"process_set={process_set!r}: pass a registered hvd.ProcessSet (hvd.init(process_sets=[...]) "
                         "or hvd.add_process_set()).")
    if process_set.process_set_id == 0:
        return full_sharding()
    if not process_set.included():
        raise ValueError(f"This rank ({basics.rank()}) is not in {process_set}: only its ranks build an optimizer "
                         "over it.")
    return ShardGroups(process_set.rank(), process_set.size(), process_set, None,
                       Scope(process_set, process_set.ranks[0]))


def _registered(ranks):
    """The process set of `ranks`: the job's own if it has one, else a new one."""
    known = getattr(basics._state, "process_sets", {})
    same = next((ps for ps in known.values() if ps.ranks == sorted(ranks)), None)
    return same if same is not None else _add(ProcessSet(ranks), "DistributedZeroOptimizer(shard_group='node')")


def node_sharding() -> ShardGroups:
    """Every rank must call it, in the same order as its other process-set changes."""
    nodes = allgather_object(basics.cross_rank(), name="zero.hybrid.nodes")
    members = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"shard_group='node' needs the same number of ranks on every node; the nodes have "
                         f"{ {n: len(m) for n, m in sorted(members.items())} } ranks. Use shard_group=None.")
    local = sizes.pop()
    if len(members) == 1:
        return full_sharding()  # one node: hybrid sharding is full sharding
    node_sets = {n: _registered(m) for n, m in sorted(members.items())}
    cross_sets = [_registered([m[j] for _, m in sorted(members.items())]) for j in range(local)]
    mine = members[nodes[basics.rank()]]
    place = mine.index(basics.rank())
    return ShardGroups(place, local, node_sets[nodes[basics.rank()]], cross_sets[place])


_TAGS = "DistributedZeroOptimizer"  # what objects.agreed_number counts the tags as


def shard_groups(shard_group, process_set, keep=None) -> ShardGroups:
    """The ranks the optimizer shards over, from its (already checked) shard_group= and
    process_set= arguments, and its collectives' tag: the next one of the job over the
    optimizer's ranks, or the tag of `keep`, an earlier ShardGroups (elastic: the optimizer
    keeps its names in the new job, where the number it holds is then skipped).
    Collective when shard_group='node'."""
    if shard_group == "node":
        groups = node_sharding()
    else:
        groups = set_sharding(process_set) if process_set is not None else full_sharding()
    scope_set = groups.scope.process_set  # None: the global set
    if keep is not None:
        reserve_number(_TAGS, scope_set, keep.tag_number)
        return replace(groups, tag=keep.tag, tag_number=keep.tag_number)
    n = agreed_number(_TAGS, scope_set)
    tag = f"zero{n or ''}" + (f"@{scope_set.process_set_id}" if scope_set is not None else "")
    return replace(groups, tag=tag, tag_number=n)
