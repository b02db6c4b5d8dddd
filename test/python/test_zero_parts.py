"""The parts of the ZeRO optimizer, each built directly with its collaborators (not
through DistributedZeroOptimizer) and checked against plain torch maths computed in the
test: OrderTrace and the stage-3 units (pure Python), then, on 2 and 3 CPU ranks over
Gloo, ShardedStorage, GradReducer with the MasterGrads sink, ParamGatherer with
MasterSource, and DeviceStep's clipping and overflow check.

The rank functions give every rank different, known inputs (refs.make(rank, ...)), so the
parent can rebuild every rank's inputs and compute what each rank must end with."""

import inspect
import re

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero.torch.zero import hybrid
from horovod_zero.torch.zero.core.gather import ParamGatherer
from horovod_zero.torch.zero.core.params import WholeParams
from horovod_zero.torch.zero.core.plan import plan_group
from horovod_zero.torch.zero.core.protocols import GatherSource, GradSink, Params, StepStrategy
from horovod_zero.torch.zero.core.reduce import GradReducer
from horovod_zero.torch.zero.core.step import DeviceStep, MasterGrads, MasterSource
from horovod_zero.torch.zero.core.storage import ShardedStorage
from horovod_zero.torch.zero.core.units import assign, find_units, wait_units
from horovod_zero.torch.zero.offload.host import HostOffload
from horovod_zero.torch.zero.offload.host_step import HostSource, HostStep
from horovod_zero.torch.zero.offload.overlap import OverlapSink
from horovod_zero.torch.zero.stage3.hooks import Stage3
from horovod_zero.torch.zero.stage3.order import OrderTrace
from refs import make

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------
# 1. OrderTrace (pure Python)


def _phase(trace, order, depth=2):
    """Visits `order`; returns what upcoming(depth) said before each visit and after the last."""
    seen = []
    for u in order:
        seen.append(trace.upcoming(depth))
        trace.visit(u)
    seen.append(trace.upcoming(depth))
    trace.end()
    return seen


def test_order_trace_records_the_first_phase_and_prefetches_the_next_in_that_order():
    t = OrderTrace()
    assert _phase(t, [0, 1, 2]) == [[], [], [], []], "nothing to predict before a recording"
    assert (t.last, t.changes) == ([0, 1, 2], 0), "the first recording is no change"
    assert _phase(t, [0, 1, 2]) == [[0, 1], [1, 2], [2], []]
    assert (t.last, t.changes) == ([0, 1, 2], 0)
    t.visit(0)
    assert t.upcoming(0) == [] and t.upcoming(5) == [1, 2]
    t.end()
    assert t.changes == 1, "a phase shorter than the recording is a change"
    t.end()  # a phase without visits changes nothing
    assert (t.last, t.changes, t.now) == ([0], 1, [])


def test_order_trace_changed_order_stops_prefetch_for_the_rest_of_the_phase_and_counts_one_change():
    t = OrderTrace()
    _phase(t, [0, 1, 2, 3])
    # 5 where 1 was recorded: no prefetch from there on, even where the order agrees again
    # (2 is the recording's third too).
    assert _phase(t, [0, 5, 2, 3]) == [[0, 1], [1, 2], [], [], []]
    assert (t.last, t.changes) == ([0, 5, 2, 3], 1), "one change per phase, and the new order replaces the recording"
    assert _phase(t, [0, 5, 2, 3]) == [[0, 5], [5, 2], [2, 3], [3], []]
    assert t.changes == 1
    _phase(t, [0, 5, 2, 3, 4])  # longer than the recording
    assert (t.last, t.changes) == ([0, 5, 2, 3, 4], 2)


def test_order_trace_prediction_prefetches_and_a_miss_is_not_a_change():
    t = OrderTrace()
    t.predict([3, 1, 2])
    assert _phase(t, [3, 2, 1]) == [[3, 1], [1, 2], [], []]
    assert (t.last, t.changes) == ([3, 2, 1], 0), "a prediction missed is no change; the real order is recorded"
    t.predict([9, 9])  # ignored once a phase is recorded
    assert t.last == [3, 2, 1]
    assert _phase(t, [2, 3, 1]) == [[3, 2], [], [], []]
    assert t.changes == 1, "a recording missed is a change"
    p = OrderTrace()
    p.predict([0, 1])
    assert _phase(p, [0, 1]) == [[0, 1], [1], []] and p.changes == 0


# ---------------------------------------------------------------------------
# 2. Units: find_units, wait_units, assign (pure Python)


class _Block(torch.nn.Module):
    def __init__(self, shared=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if shared is not None:
            self.shared = shared  # the same module in two blocks

    def forward(self, x):
        return self.lin(x)


class _Net(torch.nn.Module):
    """Units: blocks (3 blocks, 60+ parameters). Decoys: a longer ModuleList with fewer
    parameters, an empty one. Root: a tied embedding/head, a norm outside the blocks, a
    Linear shared by blocks 0 and 1, and block 2's weight tied to a module outside them."""

    def __init__(self, share_module=True):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.small = torch.nn.ModuleList([torch.nn.Linear(1, 1) for _ in range(5)])
        self.empty = torch.nn.ModuleList()
        shared = torch.nn.Linear(4, 4) if share_module else None
        self.blocks = torch.nn.ModuleList([_Block(shared), _Block(shared), _Block()])
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.out = torch.nn.Linear(4, 4, bias=False)
        self.out.weight = self.blocks[2].lin.weight


def _refused(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def test_units_default_to_the_modules_of_the_largest_module_list_by_parameters():
    net = _Net()
    assert sum(p.numel() for p in net.small.parameters()) < sum(p.numel() for p in net.blocks.parameters())
    units = find_units(net, None)
    assert len(units) == 3 and all(u is b for u, b in zip(units, net.blocks))
    assert [id(u) for u in wait_units(net, None)] == [id(b) for b in net.blocks]


def test_units_by_class_and_by_instance_in_model_order():
    net = _Net(share_module=False)
    assert [id(u) for u in find_units(net, [_Block])] == [id(b) for b in net.blocks]
    # A module two units share is no unit itself: accepted (its parameters go to the root,
    # see the assign test), by class as by default.
    shared = _Net()
    assert [id(u) for u in find_units(shared, [_Block])] == [id(b) for b in shared.blocks]
    assert [id(u) for u in find_units(shared, None)] == [id(b) for b in shared.blocks]
    # Instances come back in model.modules() order, whatever the order given.
    assert [id(u) for u in find_units(net, [net.blocks[2], net.blocks[0]])] == [id(net.blocks[0]), id(net.blocks[2])]
    assert [id(u) for u in find_units(net, [_Block, net.norm])] == [id(b) for b in net.blocks] + [id(net.norm)]
    assert [id(u) for u in wait_units(net, [net.norm])] == [id(net.norm)]


def test_units_refusals_say_what_is_wrong():
    net = _Net(share_module=False)
    two = _refused(lambda: find_units(net, [net.blocks, net.blocks[0]]))
    assert two is not None and "in two units" in two and "'blocks.0'" in two and "'blocks'" in two, two
    nested = _refused(lambda: find_units(net, [_Block, torch.nn.Linear]))
    assert nested is not None and "in two units" in nested and "blocks.0.lin" in nested, nested
    outside = _refused(lambda: find_units(net, [torch.nn.LayerNorm(4)]))
    assert outside is not None and "not in the model" in outside and "LayerNorm" in outside, outside
    assert "matches no module" in (_refused(lambda: find_units(net, [torch.nn.Conv2d])) or "")
    assert "module classes or module instances" in (_refused(lambda: find_units(net, ["blocks"])) or "")


class _Tower(torch.nn.Module):
    """No ModuleList, no Sequential: a wrapper holding one child, which holds two large
    layers and a small one."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.a, self.inner.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.inner.tiny = torch.nn.Linear(2, 2)  # under 1/32 of the parameters: stays in the root
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.inner.b(self.act(self.inner.a(x))) + self.inner.tiny.weight.sum()


def test_units_without_a_module_list_come_from_a_sequential_or_the_large_children():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert [id(u) for u in find_units(seq, None)] == [id(seq[0]), id(seq[2]), id(seq[3])]
    nested = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4),
                                                                           torch.nn.Linear(4, 4)))
    assert [id(u) for u in find_units(nested, None)] == [id(m) for m in nested[1]], "the largest Sequential's children"
    tower = _Tower()
    assert [id(u) for u in find_units(tower, None)] == [id(tower.inner.a), id(tower.inner.b)]
    assert [id(u) for u in wait_units(tower, None)] == [id(tower.inner.a), id(tower.inner.b)]
    # One layer: no unit, nothing refused; the root holds it (gathered for the whole step).
    for flat in (torch.nn.Linear(3, 3), torch.nn.Sequential(torch.nn.Linear(3, 3)),
                 torch.nn.Sequential(torch.nn.ModuleList())):
        assert find_units(flat, None) == [] and wait_units(flat, None) == []


def _shard_of(model, size=2):
    names = {p: n for n, p in model.named_parameters()}
    params = list(names)
    return {p: s for p, s in zip(params, plan_group(params, names, size, 0, 0))}, names


def test_assign_puts_tied_and_shared_parameters_in_the_root_and_others_in_their_unit():
    net = _Net()
    shard_of, names = _shard_of(net)
    index = {names[p]: s.index for p, s in shard_of.items()}
    per_unit, root = assign(net, list(net.blocks), shard_of)
    assert per_unit == [sorted([index["blocks.0.lin.weight"], index["blocks.0.lin.bias"]]),
                        sorted([index["blocks.1.lin.weight"], index["blocks.1.lin.bias"]]),
                        [index["blocks.2.lin.bias"]]], (per_unit, index)
    expected_root = ["emb.weight",  # tied with head, both outside the units
                     "blocks.0.shared.weight", "blocks.0.shared.bias",  # in blocks 0 and 1
                     "blocks.2.lin.weight",  # tied with `out`, outside the units
                     "norm.weight", "norm.bias"] + [f"small.{k}.{w}" for k in range(5) for w in ("weight", "bias")]
    assert root == sorted(index[n] for n in expected_root), (root, index)
    assert sorted(root + [i for u in per_unit for i in u]) == list(range(len(shard_of)))
    # Only the parameters in shard_of (the optimizer's) are assigned.
    some = {p: s for p, s in shard_of.items() if names[p].startswith("blocks.1")}
    assert assign(net, list(net.blocks), some) == ([[], sorted(s.index for s in some.values() if "lin" in s.name), []],
                                                   sorted(s.index for s in some.values() if "shared" in s.name))



# ---------------------------------------------------------------------------
# The Protocols (core/protocols.py) and what implements them: each part offers every
# method and attribute its protocol declares, so the wrapper can take either.

def _declared(proto):
    return sorted({n for n in vars(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {})))


def _offers(cls, name):
    """A method or class attribute, or an attribute every instance sets in its constructor."""
    return hasattr(cls, name) or re.search(rf"self\.{name}\s*=", inspect.getsource(cls.__init__)) is not None


@pytest.mark.parametrize("proto,parts", [
    (GradSink, [MasterGrads, HostOffload, OverlapSink]),
    (GatherSource, [MasterSource, HostSource]),
    (Params, [WholeParams, Stage3]),
    (StepStrategy, [DeviceStep, HostStep]),
], ids=["GradSink", "GatherSource", "Params", "StepStrategy"])
def test_each_part_offers_what_its_protocol_declares(proto, parts):
    assert len(_declared(proto)) >= 3, _declared(proto)
    for cls in parts:
        missing = [n for n in _declared(proto) if not _offers(cls, n)]
        assert not missing, f"{cls.__name__} lacks {missing} of {proto.__name__}"


# ---------------------------------------------------------------------------
# Multi-rank parts. Five parameters in two param groups, sizes padded differently on 2
# and 3 ranks: 0 is non-contiguous (a transpose), 3 has one element (the other ranks'
# shards are all padding), 4 is frozen.

SHAPES = [(5, 3), (7,), (2, 2), (1,), (3,)]
GROUPS = [(0, 2), (2, 5)]  # [first, end) of each param group
FROZEN = 4


def _initial(rank, i):
    if i == 0:
        return make(rank, (3, 5), "float32", seed=i).t()
    return make(rank, SHAPES[i], "float32", seed=i)


def _build(param_dtype=None, sharded=False, chunk_bytes=None):
    """A ShardedStorage (full sharding) of this rank's own initial values, in two param
    groups as an optimizer holds them. Returns (storage, the model's parameters, the groups)."""
    params = [torch.nn.Parameter(_initial(hvd.rank(), i), requires_grad=i != FROZEN) for i in range(len(SHAPES))]
    groups = [{"params": params[a:b]} for a, b in GROUPS]
    st = ShardedStorage(hybrid.full_sharding(), CPU, CPU, param_dtype, chunk_bytes, sharded)
    assert st.add_groups(groups, 0, None) == params
    return st, params, groups


def _values(t):
    return t.detach().float().reshape(-1).tolist()


def _padded(flat, size):
    shard = -(-flat.numel() // size)
    return torch.cat([flat, flat.new_zeros(shard * size - flat.numel())]), shard


# ---------------------------------------------------------------------------
# 3. ShardedStorage


def _storage_built(param_dtype_name, sharded, chunk_bytes):
    param_dtype = getattr(torch, param_dtype_name) if param_dtype_name else None
    assert not _initial(hvd.rank(), 0).is_contiguous()
    st, params, groups = _build(param_dtype, sharded, chunk_bytes)
    out = {
        "rank_size": (st.rank, st.size), "init_path": st.init_path,
        "plan": [[(s.index, s.name, s.group, tuple(s.shape), s.numel, s.shard, s.offset, s.size) for s in g]
                 for g in st.plan],
        "shard_of": all(st.shard_of[p] is st.shards[i] for i, p in enumerate(params)) and st.params == params,
        "masters": [_values(m) for m in st.master_params],
        "master_views": [m.data_ptr() == st.master[s.group][s.offset:].data_ptr() and m.numel() == s.shard
                         for m, s in zip(st.master_params, st.shards)],
        "groups_hold_masters": [[id(p) for p in g["params"]] for g in groups] ==
                               [[id(m) for m in st.master_params[a:b]] for a, b in GROUPS],
        "master_requires_grad": [m.requires_grad for m in st.master_params],
        "store_dtypes": [str(s.dtype) for s in st.stores],
        "store_numel": [s.numel() for s in st.stores],
    }
    if not sharded:
        out["stores"] = [_values(s) for s in st.stores]
        out["param_views"] = [p.data_ptr() == s.data_ptr() and p.shape == sh.shape and p.dtype == s.dtype
                              for p, s, sh in zip(params, st.stores, st.shards)]
        out["holds"] = [st.holds_storage(i) for i in range(len(params))]
        params[1].data = params[1].data.clone()  # as model.float() or `p.data =` after wrapping would
        out["holds_after_replace"] = st.holds_storage(1)
        return out
    esize = st.stores[0].element_size()
    at_rest = lambda i: (params[i].numel(), st.stores[i].untyped_storage().nbytes(), st.is_unsharded(i),  # noqa: E731
                         st.holds_storage(i))
    out["at_rest"] = [at_rest(i) for i in range(len(params))]
    out["unshard_returns_store"] = st.unshard(2) is st.stores[2]
    st.unshard(2)  # a second unshard keeps the storage
    out["unsharded"] = (tuple(params[2].shape), params[2].data_ptr() == st.stores[2].data_ptr(),
                        st.stores[2].untyped_storage().nbytes() == st.shards[2].padded * esize,
                        st.is_unsharded(2), st.holds_storage(2), st.is_unsharded(1))
    st.reshard(2)
    out["resharded"] = at_rest(2)
    params[3].data = torch.zeros(1, dtype=st.stores[3].dtype)  # replaced while released
    out["holds_after_replace"] = st.holds_storage(3)
    return out


def _expected_plan(size):
    plan = []
    for g, (a, b) in enumerate(GROUPS):
        offset, shards = 0, []
        for i in range(a, b):
            numel = torch.Size(SHAPES[i]).numel()
            shard = -(-numel // size)
            shards.append((i, f"param.{i}", g, SHAPES[i], numel, shard, offset, size))
            offset += shard
        plan.append(shards)
    return plan


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_bytes", [None, 8], ids=["direct", "chunked"])
def test_storage_params_are_padded_store_views_holding_rank0_values_and_masters_are_their_slices(
        ranks, param_dtype, chunk_bytes):
    n = ranks.size
    dtype = getattr(torch, param_dtype) if param_dtype else torch.float32
    for r, out in enumerate(ranks.run(_storage_built, param_dtype, False, chunk_bytes)):
        assert out["rank_size"] == (r, n)
        assert out["init_path"] == ("device" if chunk_bytes is None else "chunked (2 elements)"), out["init_path"]
        assert out["plan"] == _expected_plan(n)
        assert out["shard_of"]
        assert all(out["param_views"]) and all(out["master_views"]) and out["groups_hold_masters"]
        assert out["master_requires_grad"] == [i != FROZEN for i in range(len(SHAPES))]
        assert out["store_dtypes"] == [str(dtype)] * len(SHAPES)
        assert all(out["holds"]) and not out["holds_after_replace"]
        for i in range(len(SHAPES)):
            rank0 = _initial(0, i).reshape(-1)  # every rank starts from rank 0's values
            padded, shard = _padded(rank0, n)
            assert out["store_numel"][i] == shard * n
            assert torch.equal(torch.tensor(out["stores"][i]), padded.to(dtype).float()), (r, i)
            # The master is fp32 whatever param_dtype is, and the last shard is zero-padded.
            assert torch.equal(torch.tensor(out["masters"][i]), padded[r * shard:(r + 1) * shard]), (r, i)


@pytest.mark.parametrize("chunk_bytes", [None, 8], ids=["direct", "chunked"])
def test_storage_sharded_params_are_released_and_unshard_reshard_allocate_and_free(ranks, chunk_bytes):
    n = ranks.size
    for r, out in enumerate(ranks.run(_storage_built, "bfloat16", True, chunk_bytes)):
        assert out["plan"] == _expected_plan(n) and out["shard_of"] and all(out["master_views"])
        # At rest: no storage, an empty parameter, and that counts as holding the storage.
        assert out["at_rest"] == [(0, 0, False, True)] * len(SHAPES), out["at_rest"]
        assert out["unshard_returns_store"]
        assert out["unsharded"] == (SHAPES[2], True, True, True, True, False), out["unsharded"]
        assert out["resharded"] == (0, 0, False, True)
        assert not out["holds_after_replace"]
        for i in range(len(SHAPES)):
            padded, shard = _padded(_initial(0, i).reshape(-1), n)
            assert out["store_numel"][i] == shard * n
            assert torch.equal(torch.tensor(out["masters"][i]), padded[r * shard:(r + 1) * shard]), (r, i)


# ---------------------------------------------------------------------------
# 4. GradReducer with the MasterGrads sink
#
# Gradients: every rank has one for parameters 0 and 1, only rank 0 for 2, no rank for
# 3; 4 is frozen. Pass k's gradient of parameter i on rank r is _grad(r, i, k).

HAS_GRAD = {0: "all", 1: "all", 2: "rank0", 3: "none"}


def _grad(rank, i, k, scale=1.0):
    return make(rank, SHAPES[i], "float32", seed=100 + 10 * k + i) * scale


def _has(rank, i):
    return HAS_GRAD.get(i) == "all" or (HAS_GRAD.get(i) == "rank0" and rank == 0)


def _backward(params, reducer, k, eager, scale=1.0, has=_has, bad=None):
    """One backward pass as autograd would run it: gradients accumulate, and at stage 2 the
    post-accumulate-grad hook calls on_grad_ready (in reverse order, as backward does).
    `bad`: the last rank's gradient of parameter 0 gets it at element 0."""
    r = hvd.rank()
    for i in reversed(range(len(params))):
        if not has(r, i):
            continue
        p = params[i]
        g = _grad(r, i, k, scale)
        if bad is not None and i == 0 and r == hvd.size() - 1:
            g.view(-1)[0] = bad
        p.grad = g if p.grad is None else p.grad + g
        if eager:
            reducer.on_grad_ready(p)


def _rs_stats():
    stats = [s for s in hvd.collective_stats() if s["op"] == "reducescatter"]
    return sum(s["collectives"] for s in stats), sum(s["tensors"] for s in stats)


def _finish(red, sink, unscale=1.0):
    """GradReducer.finish(), then what the step does first: the sink casts the deferred
    shards it was handed (MasterGrads keeps them uncast until the step reads them)."""
    red.finish(unscale)
    sink.take_deferred()


def _reduced(eager, passes, bpps, bucket_bytes, unscale, coalesce):
    st, params, _ = _build()
    sink = MasterGrads(st)
    red = GradReducer(st, sink, eager, bpps, None, bucket_bytes)
    red.extend(len(params))
    hvd.collective_stats(reset=True)
    if coalesce:
        with red.coalesce():
            for k in range(passes):
                _backward(params, red, k, eager)
            in_block = _rs_stats()
            busy = red.busy
    else:
        for k in range(passes):
            _backward(params, red, k, eager)
        in_block, busy = None, red.busy
    _finish(red, sink, unscale)
    out = {"in_block": in_block, "busy_before_finish": busy, "busy_after_finish": red.busy,
           "rs_tensors": _rs_stats()[1], "full_grads_left": [p.grad is not None for p in params],
           "grads": [None if m.grad is None else _values(m.grad) for m in st.master_params]}
    red.finish(unscale)  # a second finish before the step is a no-op
    out["rs_tensors_after_second_finish"] = _rs_stats()[1]
    return out


def _expected_grad(rank, size, i, passes, unscale=1.0):
    """This rank's shard of the average over ranks of the gradient summed over passes."""
    total = sum(_grad(r, i, k).double() for r in range(size) for k in range(passes) if _has(r, i)) / size
    padded, shard = _padded(total.reshape(-1), size)
    return (padded[rank * shard:(rank + 1) * shard] * unscale).float()


def _check_grads(grads, rank, size, passes, unscale=1.0):
    for i in range(len(SHAPES)):
        if i == FROZEN or HAS_GRAD.get(i) == "none":
            assert grads[i] is None, (rank, i, "no rank had a gradient: grad must be None")
            continue
        torch.testing.assert_close(torch.tensor(grads[i]), _expected_grad(rank, size, i, passes, unscale),
                                   rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank} param {i}: {m}")


@pytest.mark.parametrize("eager,passes,bpps,coalesce,bucket_bytes", [
    (True, 1, 1, False, 1),        # stage 2: each gradient as it is ready, a bucket each
    (True, 1, 1, False, 1 << 30),  # stage 2: one bucket, sent at finish()
    (False, 1, 1, False, 1),       # stage 1: everything at finish()
    (True, 2, 2, False, 1),        # backward_passes_per_step=2: the two passes summed, then reduced once
    (False, 2, 2, False, 1),
    (True, 3, 1, True, 1),         # coalesce(): reduced once, on exit
], ids=["stage2-tiny_bucket", "stage2-big_bucket", "stage1", "stage2-bpps2", "stage1-bpps2", "stage2-coalesce3"])
def test_reducer_master_grads_are_this_ranks_shard_of_the_rank_average_times_unscale(
        ranks, eager, passes, bpps, coalesce, bucket_bytes):
    unscale = 0.25
    for r, out in enumerate(ranks.run(_reduced, eager, passes, bpps, bucket_bytes, unscale, coalesce)):
        _check_grads(out["grads"], r, ranks.size, passes, unscale)
        # Every trained parameter (0-3) is reduced once, the gradless ones as zeros; the frozen never.
        assert out["rs_tensors"] == out["rs_tensors_after_second_finish"] == 4, out
        # busy: reductions wait for finish(); at stage 1 the gradients are still on the parameters.
        assert out["busy_before_finish"] == eager and out["busy_after_finish"]
        assert not any(out["full_grads_left"]), "the full gradients are taken from the parameters"
        if coalesce:
            assert out["in_block"] == (0, 0), "nothing is reduced inside a coalesce() block"


FOLDS = {"none": lambda s: False, "all": lambda s: True, "even": lambda s: s.index % 2 == 0}


def _reduced_summing(folds, eager, passes, bpps, coalesce, raw):
    """As _reduced, with a sink that folds the mean into its own multiply for the shards
    `folds` names: the reductions (op per shard), and each shard's gradient as the step reads
    it: its .grad, or with `raw` (the master Adam path) the uncast output times its factor."""
    from horovod_zero.torch import enqueue as ops
    st, params, _ = _build()
    sink = MasterGrads(st, folds=FOLDS[folds])
    red = GradReducer(st, sink, eager, bpps, torch.bfloat16 if raw else None, 1)
    red.extend(len(params))
    seen, enqueue = {}, ops._enqueue

    def spy(op, ins, outs, names, reduce_op=ops.Sum, *args, **kwargs):
        for n in names:
            if ".grad." in n:
                seen.setdefault(int(n.split(".")[2]), set()).add("sum" if reduce_op == ops.Sum else "average")
        return enqueue(op, ins, outs, names, reduce_op, *args, **kwargs)
    ops._enqueue = spy
    try:
        if coalesce:
            with red.coalesce():
                for k in range(passes):
                    _backward(params, red, k, eager)
        else:
            for k in range(passes):
                _backward(params, red, k, eager)
        red.finish(0.25)
    finally:
        ops._enqueue = enqueue
    kept = sink.take_deferred(raw=(lambda i: True) if raw else None)
    grads = [None if m.grad is None else _values(m.grad) for m in st.master_params]
    for i, (out, factor) in kept.items():
        grads[i] = _values(out.float() * factor)
    return {i: sorted(v) for i, v in seen.items()}, grads, sorted(kept)


@pytest.mark.parametrize("folds", ["none", "all", "even"])
@pytest.mark.parametrize("eager,passes,bpps,coalesce,raw", [
    (True, 1, 1, False, False),   # stage 2
    (False, 1, 1, False, False),  # stage 1
    (True, 2, 2, False, False),   # two passes, one reduction
    (True, 2, 1, True, False),    # coalesce(): the passes' sum reduced on exit
    (True, 1, 1, False, True),    # bf16 reductions handed over uncast, as to the master Adam kernel
], ids=["stage2", "stage1", "bpps2", "coalesce2", "uncast"])
def test_reducer_sums_where_the_sink_applies_the_mean_and_the_gradient_is_still_the_average(
        ranks, folds, eager, passes, bpps, coalesce, raw):
    for r, (seen, grads, kept) in enumerate(ranks.run(_reduced_summing, folds, eager, passes, bpps, coalesce, raw)):
        for i in (0, 1, 2, 3):  # the trained ones; 3 had no gradient anywhere and is reduced as zeros
            want = "sum" if FOLDS[folds](type("S", (), {"index": i})) and ranks.size > 1 else "average"
            assert seen[i] == [want], (r, i, seen)
        assert FROZEN not in seen
        for i in range(len(SHAPES)):
            if i == FROZEN or HAS_GRAD.get(i) == "none":
                assert grads[i] is None, (r, i)
                continue
            tol = 2e-2 if raw else 1e-6  # bf16 on the wire
            torch.testing.assert_close(torch.tensor(grads[i]), _expected_grad(r, ranks.size, i, passes, 0.25),
                                       rtol=tol, atol=tol, msg=lambda m: f"rank {r} param {i}: {m}")
        if raw:
            assert kept == [0, 1, 2], kept


def _outputs_alive_at_each_take(eager, take_bytes):
    """For each batch the sink takes in finish(): how many earlier batches' reduced outputs
    are still alive, and the batch's size. None are alive: they are freed as they are taken
    and never all exist beside the fp32 gradients the sink makes (the update's memory peak
    at stage 2), while one batch lets the sink cast many shards at once."""
    import weakref
    st, params, _ = _build()
    sink = MasterGrads(st)
    taken, alive = [], []
    take = sink.take_grads

    def recording(items):
        if items:
            alive.append((sum(r() is not None for r in taken), len(items)))
        taken.extend(weakref.ref(o) for _, outs, _ in items for o in outs)
        return take(items)
    sink.take_grads = recording
    # Reduced in bf16: the sink makes an fp32 copy (an fp32 output would be the .grad itself).
    red = GradReducer(st, sink, eager, 1, torch.bfloat16, 1)
    red.TAKE_BYTES = sink.TAKE_BYTES = take_bytes
    red.extend(len(params))
    _backward(params, red, 0, eager)
    _finish(red, sink)
    assert all(p.grad is None for p in params)
    return alive, [m.grad.dtype for m in st.master_params if m.grad is not None]


@pytest.mark.parametrize("eager", [True, False], ids=["stage2", "stage1"])
def test_reducer_frees_each_shards_outputs_as_the_sink_takes_them(ranks, eager):
    # parameters 0-2 had gradients somewhere: one batch each, or all three in one
    for (alive, dtypes), (batched, _) in zip(ranks.run(_outputs_alive_at_each_take, eager, 1),
                                             ranks.run(_outputs_alive_at_each_take, eager, 1 << 30)):
        assert alive == [(0, 1)] * 3, alive
        assert batched == [(0, 3)], batched
        assert dtypes == [torch.float32] * 3, dtypes


def _everywhere(rank, i):
    return i in (0, 1, 2)


def _reduced_every_pass(passes):
    """Stage 2 without accumulation settings: every pass is reduced, and the sink sums them.
    Every rank has gradients for parameters 0-2 in every pass: a rank without one in a pass
    makes fewer reductions of it than the others (zero.grad.<i>.<k> names the k-th), and
    the others then wait for the missing one forever."""
    st, params, _ = _build()
    sink = MasterGrads(st)
    red = GradReducer(st, sink, True, 1, None, 1)
    red.extend(len(params))
    hvd.collective_stats(reset=True)
    for k in range(passes):
        _backward(params, red, k, True, has=_everywhere)
    _finish(red, sink)
    return _rs_stats()[1], [None if m.grad is None else _values(m.grad) for m in st.master_params]


def test_reducer_stage2_reduces_every_pass_and_the_sink_sums_the_reductions(ranks):
    passes, n = 2, ranks.size
    for r, (tensors, grads) in enumerate(ranks.run(_reduced_every_pass, passes)):
        assert tensors == passes * 3 + 1, tensors  # parameter 3 (no gradient anywhere) once, at finish()
        for i in range(len(SHAPES)):
            if i not in (0, 1, 2):
                assert grads[i] is None
                continue
            total = sum(_grad(q, i, k).double() for q in range(n) for k in range(passes)) / n
            padded, shard = _padded(total.reshape(-1), n)
            torch.testing.assert_close(torch.tensor(grads[i]), padded[r * shard:(r + 1) * shard].float(),
                                       rtol=1e-6, atol=1e-6)


def _discarded(eager, bpps):
    st, params, _ = _build()
    sink = MasterGrads(st)
    red = GradReducer(st, sink, eager, bpps, None, 1)
    red.extend(len(params))
    # Dropped: zero_grad() before step(). Every rank has gradients for the parameters
    # submitted here: one submitted by some ranks only would leave their discard() waiting
    # for ranks that never submit it.
    _backward(params, red, 0, eager, scale=100.0, has=_everywhere)
    red.discard()
    busy_after_discard = red.busy
    for p in params:
        p.grad = None
    hvd.collective_stats(reset=True)
    for k in range(bpps):
        _backward(params, red, k, eager)
    _finish(red, sink)
    first = [None if m.grad is None else _values(m.grad) for m in st.master_params]
    tensors = _rs_stats()[1]
    # The next step, as the optimizer runs it after step() and zero_grad().
    red.hand_over()
    for m in st.master_params:
        m.grad = None
    for k in range(bpps):
        _backward(params, red, k, eager)
    _finish(red, sink)
    second = [None if m.grad is None else _values(m.grad) for m in st.master_params]
    return busy_after_discard, tensors, first, second


@pytest.mark.parametrize("eager", [True, False], ids=["stage2", "stage1"])
@pytest.mark.parametrize("bpps", [1, 2], ids=["bpps1", "bpps2"])
def test_reducer_discard_drops_the_gradients_so_far_and_the_next_step_starts_afresh(ranks, eager, bpps):
    for r, (busy, tensors, first, second) in enumerate(ranks.run(_discarded, eager, bpps)):
        assert not busy
        # With bpps=2, a discarded pass must not count towards the next step's two passes.
        assert tensors == 4, tensors
        _check_grads(first, r, ranks.size, bpps)
        _check_grads(second, r, ranks.size, bpps)


BUCKET_NUMEL = 12  # divisible by 2 and 3: no padding, 48 bytes in fp32 on either size


def _bucket_collectives(bucket_bytes, count):
    """`count` parameters of 48 bytes, every rank a gradient for each; a barrier after each
    on_grad_ready, so that separate buckets cannot meet in one cycle of the runtime."""
    r = hvd.rank()
    params = [torch.nn.Parameter(make(r, (BUCKET_NUMEL,), "float32", seed=i)) for i in range(count)]
    st = ShardedStorage(hybrid.full_sharding(), CPU, CPU, None, None, False)
    st.add_groups([{"params": params}], 0, None)
    sink = MasterGrads(st)
    red = GradReducer(st, sink, True, 1, None, bucket_bytes)
    red.extend(count)
    hvd.collective_stats(reset=True)
    after_each = []
    for i, p in enumerate(params):
        p.grad = make(r, (BUCKET_NUMEL,), "float32", seed=300 + i)
        red.on_grad_ready(p)
        hvd.barrier()
        after_each.append(_rs_stats()[0])
    _finish(red, sink)
    return after_each, _rs_stats(), [_values(m.grad) for m in st.master_params]


@pytest.mark.parametrize("bucket_params,expected", [
    (0, ([1, 2, 3, 4, 5], 5)),  # bucket_bytes=1: every gradient is a full bucket
    (2, ([0, 1, 1, 2, 2], 3)),  # two gradients a bucket; the fifth goes at finish()
    (None, ([0, 0, 0, 0, 0], 1)),  # larger than the model: one collective at finish()
], ids=["1byte", "2params", "whole_model"])
def test_reducer_sends_one_grouped_reduce_scatter_per_full_bucket(ranks, bucket_params, expected):
    count = 5
    bucket_bytes = {0: 1, 2: 2 * BUCKET_NUMEL * 4, None: 1 << 30}[bucket_params]
    n = ranks.size
    for r, (after_each, (collectives, tensors), grads) in enumerate(ranks.run(_bucket_collectives, bucket_bytes,
                                                                               count)):
        assert (after_each, collectives) == expected, (after_each, collectives)
        assert tensors == count
        for i in range(count):
            full = sum(make(q, (BUCKET_NUMEL,), "float32", seed=300 + i).double() for q in range(n)) / n
            shard = BUCKET_NUMEL // n
            torch.testing.assert_close(torch.tensor(grads[i]), full[r * shard:(r + 1) * shard].float(),
                                       rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# 5. ParamGatherer with MasterSource


def _new_master(rank, i, shard):
    return make(rank, (shard,), "float32", seed=200 + i)


def _gathered(param_dtype_name, downcast, sharded):
    r = hvd.rank()
    param_dtype = getattr(torch, param_dtype_name) if param_dtype_name else None
    st, params, _ = _build(param_dtype, sharded)
    gatherer = ParamGatherer(st, MasterSource(st), downcast)
    with torch.no_grad():
        for i, m in enumerate(st.master_params):
            m.copy_(_new_master(r, i, st.shards[i].shard))
    everything = list(range(len(params)))
    hvd.collective_stats(reset=True)
    gatherer.gather([0, 2])
    trace = [("gather [0, 2]", sorted(gatherer.in_flight), [st.is_unsharded(i) for i in everything])]
    gatherer.wait([0])
    trace.append(("wait [0]", sorted(gatherer.in_flight), [st.is_unsharded(i) for i in everything]))
    gatherer.gather([1, 3, 4])
    gatherer.wait()
    trace.append(("wait all", sorted(gatherer.in_flight), [st.is_unsharded(i) for i in everything]))
    wire = sorted({s["dtype"] for s in hvd.collective_stats() if s["op"] == "allgather"})
    views = [p.data_ptr() == s.data_ptr() and tuple(p.shape) == tuple(sh.shape)
             for p, s, sh in zip(params, st.stores, st.shards)]
    return trace, wire, views, [str(p.dtype) for p in params], [_values(p) for p in params]


def _slot_reads():
    """A bf16 parameter gathered from its slot ([Note: the step writes the gather's input]):
    what rank r's part of each gathered parameter holds when the step wrote its slot, when
    the master changed after that, after forget(), and when nothing was written."""
    from horovod_zero.torch.zero.core import master_adam
    r = hvd.rank()
    saved = master_adam.available
    master_adam.available = lambda device: True  # as on CUDA, where the kernel writes the slots
    try:
        st, params, _ = _build(torch.bfloat16)
        source = MasterSource(st, write_slots=True)
    finally:
        master_adam.available = saved
    gatherer = ParamGatherer(st, source, True)
    i, shard = 0, st.shards[0].shard
    mine = slice(r * shard, (r + 1) * shard)
    seen = {}

    def gather(case):
        gatherer.gather([i])
        gatherer.wait()
        seen[case] = _values(st.stores[i][mine])

    def write(value):
        slots = source.slots([i])
        slots[0].fill_(value)
        source.wrote([i], slots)
    with torch.no_grad():
        st.master_params[i].fill_(1.0)
        write(7.0)
        gather("written")
        gather("read once")  # the next gather casts the master again
        write(7.0)
        st.master_params[i].fill_(2.0)  # rewritten after the step wrote its slot (a load, say)
        gather("master changed")
        write(7.0)
        source.forget()
        st.master_params[i].fill_(3.0)
        gather("forgotten")
    wire = sorted({s["dtype"] for s in hvd.collective_stats() if s["op"] == "allgather"})
    return seen, source.slot_dtype(i), wire


def test_a_slot_the_step_wrote_is_gathered_once_and_only_while_its_master_is_unchanged(ranks):
    for r, (seen, slot_dtype, wire) in enumerate(ranks.run(_slot_reads)):
        assert slot_dtype == torch.bfloat16 and wire == ["bfloat16"], (slot_dtype, wire)
        expected = {"written": 7.0, "read once": 1.0, "master changed": 2.0, "forgotten": 3.0}
        for case, value in expected.items():
            assert set(seen[case]) == {value}, (r, case, seen[case][:4])


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("downcast", [True, False], ids=["downcast", "cast_after"])
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded_params"])
def test_gatherer_puts_every_ranks_masters_cast_to_param_dtype_into_every_parameter(
        ranks, param_dtype, downcast, sharded):
    n = ranks.size
    dtype = getattr(torch, param_dtype) if param_dtype else torch.float32
    for r, (trace, wire, views, dtypes, values) in enumerate(ranks.run(_gathered, param_dtype, downcast, sharded)):
        unsharded = [True] * len(SHAPES)
        if sharded:  # gather() allocates the storage at once; the others stay released
            assert trace[0] == ("gather [0, 2]", [0, 2], [True, False, True, False, False]), trace
            assert trace[1] == ("wait [0]", [2], [True, False, True, False, False]), trace
        else:
            assert trace[0] == ("gather [0, 2]", [0, 2], unsharded) and trace[1] == ("wait [0]", [2], unsharded)
        assert trace[2] == ("wait all", [], unsharded), trace
        assert all(views) and dtypes == [str(dtype)] * len(SHAPES)
        # param_dtype on the wire when the cast is in the gather's copy-in; fp32 otherwise.
        assert wire == [str(dtype if downcast else torch.float32).replace("torch.", "")], wire
        for i, shape in enumerate(SHAPES):
            numel = torch.Size(shape).numel()
            shard = -(-numel // n)
            full = torch.cat([_new_master(q, i, shard) for q in range(n)])[:numel].view(shape)
            assert torch.equal(torch.tensor(values[i]), full.to(dtype).float().reshape(-1)), (r, i)


# ---------------------------------------------------------------------------
# 6. DeviceStep: clip and found_inf


def _stepped(max_norm, bad):
    """Reduced gradients as in _reduced (stage 2); `bad` ("inf"/"nan"/None): the last rank's
    gradient of parameter 0 holds it at element 0, which only rank 0's shard holds."""
    st, params, _ = _build()
    # The inner optimizer is used by step() only: clip() and found_inf() never reach it (and
    # a first torch.optim optimizer costs seconds of imports in each rank).
    step = DeviceStep(st, None, True, False)
    red = GradReducer(st, step.sink, True, 1, None, 1 << 20)
    red.extend(len(params))
    _backward(params, red, 0, True, bad=float(bad) if bad else None)
    _finish(red, step.sink)
    local_finite = all(bool(torch.isfinite(m.grad).all()) for m in st.master_params if m.grad is not None)
    found = step.found_inf()
    norm = step.clip(max_norm, red.order_after) if not bad else None
    return (found, local_finite, None if norm is None else (float(norm), str(norm.dtype), norm.dim()),
            [None if m.grad is None else _values(m.grad) for m in st.master_params])


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "below_max"])
def test_device_step_clip_uses_the_global_norm_of_the_averaged_gradients(ranks, max_norm):
    n = ranks.size
    full = [sum(_grad(q, i, 0).double() for q in range(n) if _has(q, i)).reshape(-1) / n
            for i in range(len(SHAPES)) if HAS_GRAD.get(i) in ("all", "rank0")]
    norm = float(torch.linalg.vector_norm(torch.cat(full)))
    coef = max_norm / (norm + 1e-6)
    assert (coef < 1) == (max_norm == 0.5), "the test's clipping case must clip"
    for r, (found, _, (got, dtype, dim), grads) in enumerate(ranks.run(_stepped, max_norm, None)):
        assert not found
        assert abs(got - norm) <= 1e-5 * norm and dtype == "torch.float32" and dim == 0, (got, norm)
        _check_grads(grads, r, n, 1, unscale=min(coef, 1.0))


@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_device_step_found_inf_is_true_on_every_rank_when_one_rank_has_one(ranks, bad):
    results = ranks.run(_stepped, 1.0, bad)
    assert [found for found, _, _, _ in results] == [True] * ranks.size
    # Only rank 0's shard holds the bad element: the others' own gradients are finite.
    assert [finite for _, finite, _, _ in results] == [False] + [True] * (ranks.size - 1)


def test_adam_and_adamw_left_to_their_default_kernel_step_fused():
    from horovod_zero.torch.zero.core import fused
    p = [torch.nn.Parameter(torch.randn(5))]
    default, chosen = torch.optim.AdamW(p, lr=0.1), torch.optim.Adam(p, lr=0.1, foreach=True)
    sgd, capturable = torch.optim.SGD(p, lr=0.1), torch.optim.Adam(p, lr=0.1, capturable=True)
    for o in (default, chosen, sgd, capturable):
        fused.prefer_fused(o)
    assert default.param_groups[0]["fused"] is True and default.param_groups[0]["foreach"] is False
    assert chosen.param_groups[0]["fused"] is None and chosen.param_groups[0]["foreach"] is True
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    assert capturable.param_groups[0]["fused"] is None


def test_the_fused_step_matches_foreach_to_fp32_rounding():
    from horovod_zero.torch.zero.core import fused
    a = [torch.nn.Parameter(torch.randn(257)) for _ in range(3)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    ref, fast = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, foreach=True), torch.optim.AdamW(b, lr=1e-2,
                                                                                                 weight_decay=0.1)
    fused.prefer_fused(fast)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for x, y in zip(a, b):
            x.grad = torch.randn(257, generator=g)
            y.grad = x.grad.clone()
        ref.step()
        fast.step()
    assert fast.param_groups[0]["fused"]
    assert max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(a, b)) < 1e-6


def test_a_loaded_step_moves_where_the_fused_kernel_reads_it():
    from horovod_zero.torch.zero.core import fused
    p = [torch.nn.Parameter(torch.randn(5))]
    o = torch.optim.AdamW(p, lr=0.1)
    fused.prefer_fused(o)
    o.state[p[0]] = {"step": torch.tensor(3, dtype=torch.float64), "exp_avg": torch.zeros(5),
                     "exp_avg_sq": torch.zeros(5)}
    fused.place_steps(o)
    assert o.state[p[0]]["step"].dtype == torch.float32 and o.state[p[0]]["step"].item() == 3
    p[0].grad = torch.ones(5)
    o.step()
    assert o.state[p[0]]["step"].item() == 4
