"""The rest of Horovod's torch API: compression, allgather_object,
broadcast_optimizer_state, sparse_allreduce_async, Adasum's refusal and the query
functions, each against a reference computed with plain torch on every rank."""

import os

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch
from refs import make, scatter_slice


# --- compression --------------------------------------------------------------

def test_fp16_compressor_round_trips_floats_and_leaves_other_dtypes():
    t = torch.tensor([1.0, 2.5, -3.0], dtype=torch.float64)
    wire, ctx = hvd.Compression.fp16.compress(t)
    assert wire.dtype == torch.float16 and ctx == torch.float64
    back = hvd.Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.equal(back, t)
    ints = torch.arange(4)
    wire, ctx = hvd.Compression.fp16.compress(ints)
    assert wire is ints and hvd.Compression.fp16.decompress(wire, ctx) is ints
    wire, ctx = hvd.Compression.none.compress(t)
    assert wire is t and hvd.Compression.none.decompress(wire, ctx) is t


def _allreduce_compressed():
    n, r = hvd.size(), hvd.rank()
    xs = [make(k, (64,), "float32", 7) for k in range(n)]
    hvd.collective_stats(reset=True)
    out = hvd.allreduce(xs[r], name="api.fp16", compression=hvd.Compression.fp16)
    wire = {s["dtype"] for s in hvd.collective_stats()}
    ref = sum(x.double() for x in xs) / n
    rs = hvd.reducescatter(xs[r], name="api.rs.fp16", compression=hvd.Compression.fp16, op=hvd.Sum)
    rs_ref = scatter_slice(sum(x.double() for x in xs), n, r)
    return (out.dtype, wire, float((out.double() - ref).abs().max()),
            rs.dtype, float((rs.double() - rs_ref).abs().max()))


def test_allreduce_and_reducescatter_accept_compression(ranks):
    for dtype, wire, err, rs_dtype, rs_err in ranks.run(_allreduce_compressed):
        assert dtype == rs_dtype == torch.float32 and wire == {"float16"}
        assert err < 5e-3 and rs_err < 1e-2


# --- allgather_object -----------------------------------------------------------

def _objects(k):
    return [{"rank": k, "text": "x" * (50 * k)}, k, None][k % 3]  # different types and sizes per rank


def _allgather_object():
    return hvd.allgather_object(_objects(hvd.rank())), hvd.allgather_object(("again", hvd.rank()))


def test_allgather_object_returns_every_ranks_object_in_rank_order(ranks):
    for objs, again in ranks.run(_allgather_object):
        assert objs == [_objects(k) for k in range(ranks.size)]
        assert again == [("again", k) for k in range(ranks.size)]


# --- broadcast_optimizer_state -----------------------------------------------------

def _trained_adam(k):
    """Rank k's optimizer: its own lr, k steps on data of its own (none for rank 0)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (k + 1), betas=(0.8 + 0.01 * k, 0.99))
    for step in range(k):
        opt.zero_grad()
        model(make(k, (5, 4), "float32", step)).pow(2).sum().backward()
        opt.step()
    if k > 0:
        opt.state[model[0].weight]["note"] = f"from rank {k}"  # a non-tensor state value
    return model, opt


def _state_of(opt):
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state.get(p, {}).items()} for p in params]
    return groups, state


def _same_state(a, b):
    (ga, sa), (gb, sb) = a, b
    if ga != gb or len(sa) != len(sb):
        return False
    for x, y in zip(sa, sb):
        if x.keys() != y.keys():
            return False
        for key in x:
            if torch.is_tensor(x[key]) != torch.is_tensor(y[key]):
                return False
            if torch.is_tensor(x[key]) and not torch.equal(x[key], y[key]):
                return False
            if not torch.is_tensor(x[key]) and x[key] != y[key]:
                return False
    return True


def _broadcast_optimizer_state(root, wrap):
    n, r = hvd.size(), hvd.rank()
    model, opt = _trained_adam(r)
    if wrap:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    expected = _state_of(_trained_adam(root)[1])  # root's, rebuilt here
    before = _same_state(_state_of(opt), expected)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    return before, _same_state(_state_of(opt), expected)


@pytest.mark.parametrize("root", ["last", "first"], ids=["root_with_state", "root_without_state"])
def test_broadcast_optimizer_state_gives_every_rank_roots_state_and_hyperparameters(ranks, root):
    root_rank = ranks.size - 1 if root == "last" else 0
    for r, (before, after) in enumerate(ranks.run(_broadcast_optimizer_state, root_rank, False)):
        assert before == (r == root_rank), "ranks must start with different state"
        assert after, f"rank {r} does not hold rank {root_rank}'s optimizer state"


def test_broadcast_optimizer_state_through_a_distributed_optimizer(ranks):
    for r, (_, after) in enumerate(ranks.run(_broadcast_optimizer_state, 1, True)):
        assert after, f"rank {r}"


def _broadcast_state_mismatch():
    model = torch.nn.Linear(2, 2)
    layers = [model] if hvd.rank() == 0 else [model, torch.nn.Linear(1, 1)]  # rank 0 has fewer parameters
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1)
    try:
        hvd.broadcast_optimizer_state(opt, 0)
    except ValueError as e:
        return str(e)


def test_broadcast_optimizer_state_refuses_different_optimizers_on_every_rank(ranks):
    for msg in ranks.run(_broadcast_state_mismatch):
        assert msg is not None and "build the same optimizer" in msg, msg


class _ModelNoGrad(torch.nn.Module):
    """Horovod's test_broadcast_state_no_grad model: an integer parameter that takes no
    gradient, and a float one."""

    def __init__(self, a, b):
        super().__init__()
        self.a = torch.nn.Parameter(a.int(), requires_grad=False)
        self.b = torch.nn.Parameter(b)

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def _broadcast_state_no_grad(wrap, backward_first):
    """Horovod's test, and what its dummy step leaves: the float parameter's gradient present
    and the same on every rank, the integer one's None; our weights unmoved by it."""
    r = hvd.rank()
    model = _ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4, generator=torch.Generator().manual_seed(r)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    if wrap:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.b.detach().clone()
    if backward_first:  # a rank's own gradient, different on every rank, must not survive
        model.b.grad = torch.full((4,), float(r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0, name=f"no_grad.{wrap}.{backward_first}")
    return (opt.param_groups[0]["params"][0].grad is None, bool(torch.equal(grad, bgrad)), grad.tolist(),
            torch.equal(model.b.detach(), before), len(opt.state))


@pytest.mark.parametrize("wrap", [True, False], ids=["distributed_optimizer", "torch_optimizer"])
@pytest.mark.parametrize("backward_first", [False, True], ids=["fresh", "after_backward"])
def test_broadcast_state_of_an_optimizer_that_never_stepped_leaves_equal_gradients(ranks, wrap, backward_first):
    for int_grad_none, equal, grad, unmoved, state in ranks.run(_broadcast_state_no_grad, wrap, backward_first):
        assert int_grad_none and equal, (int_grad_none, equal)
        assert grad == [0.0] * 4, grad  # Horovod's dummy step leaves zeros
        assert unmoved and state == 0  # but no step: no weight decay, no momentum buffers


def _stepped_ranks_keep_their_gradients():
    """A rank whose optimizer has state keeps its gradients (Horovod's rule); a rank without state gets zeros."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hvd.rank() == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return [float(p.grad.abs().max()) for p in model.parameters()]


def test_only_ranks_without_state_get_zero_gradients(ranks):
    for r, grads in enumerate(ranks.run(_stepped_ranks_keep_their_gradients)):
        assert grads == ([7.0, 7.0] if r == 0 else [0.0, 0.0]), (r, grads)


# --- sparse allreduce --------------------------------------------------------------

def _sparse_input(k, nnz):
    g = torch.Generator().manual_seed(50 + k)
    idx = torch.randint(0, 6, (2, nnz), generator=g)
    return torch.sparse_coo_tensor(idx, torch.randn(nnz, 3, generator=g, dtype=torch.float64), (6, 5, 3))


def _sparse_allreduce(op_name):
    n, r = hvd.size(), hvd.rank()
    xs = [_sparse_input(k, 0 if k == 1 else 3 + k) for k in range(n)]  # rank 1 has no entries
    handle = hvd.sparse_allreduce_async(xs[r], name=f"api.sparse.{op_name}", op=getattr(hvd, op_name))
    out = hvd.synchronize(handle)
    ref = sum(x.to_dense() for x in xs) / (n if op_name == "Average" else 1)
    return out.is_sparse, float((out.to_dense() - ref).abs().max())


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_sparse_allreduce_matches_the_dense_reduction(ranks, op_name):
    for is_sparse, err in ranks.run(_sparse_allreduce, op_name):
        assert is_sparse and err < 1e-12


# --- Adasum ------------------------------------------------------------------------

def _adasum_refusals():
    msgs = []
    for call in (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="api.adasum"),
                 lambda: hvd.grouped_allreduce_async([torch.ones(2)], op=hvd.Adasum),
                 lambda: hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), "api.sp", hvd.Adasum)):
        try:
            call()
            msgs.append(None)
        except NotImplementedError as e:
            msgs.append(str(e))
    return msgs


def test_adasum_is_refused_saying_what_to_use(ranks):
    for msgs in ranks.run(_adasum_refusals):
        assert all(m and "not supported" in m and "op=hvd.Average" in m for m in msgs), msgs


# --- query functions ---------------------------------------------------------------

def _queries():
    return {f: getattr(hvd, f)() for f in ("mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
                                           "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
                                           "rocm_built", "is_homogeneous")}


def test_query_functions_describe_this_library(ranks):
    for q in ranks.run(_queries):
        assert q["gloo_built"] is True and q["gloo_enabled"] is True and q["is_homogeneous"] is True
        assert not any(q[f] for f in ("mpi_threads_supported", "mpi_built", "mpi_enabled", "ddl_built", "ccl_built",
                                      "rocm_built"))
        assert isinstance(q["nccl_built"], int) and bool(q["nccl_built"]) == q["cuda_built"]


def _homogeneity_with_uneven_nodes():
    # Ranks 0 and 1 on one node, rank 2 alone on another (torchrun's variables).
    r = int(os.environ["RANK"])
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = ("2", str(r)) if r < 2 else ("1", "0")
    hvd.init()
    try:
        return hvd.is_homogeneous(), hvd.local_size()
    finally:
        hvd.shutdown()


def test_is_homogeneous_is_false_when_nodes_run_different_numbers_of_ranks():
    out = launch(_homogeneity_with_uneven_nodes, 3)
    assert sorted(out) == [0, 1, 2], out
    assert [out[r] for r in range(3)] == [("ok", (False, 2)), ("ok", (False, 2)), ("ok", (False, 1))], out
