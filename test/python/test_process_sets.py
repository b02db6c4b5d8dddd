"""Process sets (hvd.ProcessSet, add_process_set, process_set= on every op) at 3 and
4 CPU ranks, against plain-torch references computed here from each rank's known
inputs. The pools run with HOROVOD_DYNAMIC_PROCESS_SETS=1; each test adds the sets
it uses and removes them again, so that the pool's later tests start clean."""

import time

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch, shared_pool
from refs import assert_close, make, reduce_ref, scatter_slice

DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def _pool(size):
    return shared_pool(size, env=DYNAMIC)


def _inputs(ranks, shape, seed):
    return {k: make(k, shape, "float32", seed) for k in ranks}


# --- disjoint sets beside the global one --------------------------------------------------


def _disjoint_sets():
    low, high = hvd.add_process_set([0, 1]), hvd.add_process_set(hvd.ProcessSet([3, 2]))
    try:
        r = hvd.rank()
        ps, other = (low, high) if r < 2 else (high, low)
        assert (ps.included(), other.included()) == (True, False)
        assert (ps.size(), ps.rank(), ps.ranks) == (2, r % 2, [0, 1] if r < 2 else [2, 3])
        assert hvd.global_process_set.ranks == [0, 1, 2, 3] and hvd.size() == 4 and hvd.rank() == r
        members = ps.ranks
        ins, every = _inputs(members, (5, 3), 1), _inputs(range(4), (5, 3), 1)
        # The same name in the set and in the global set, in flight together.
        in_set = hvd.allreduce_async(ins[r], op=hvd.Average, name="t", process_set=ps)
        in_all = hvd.allreduce_async(every[r], op=hvd.Sum, name="t")
        assert_close(hvd.synchronize(in_set), reduce_ref(list(ins.values()), "Average").float(), "float32")
        assert_close(hvd.synchronize(in_all), reduce_ref(list(every.values()), "Sum").float(), "float32")

        rows = {k: make(k, (k + 1, 2), "float32", 2) for k in members}  # uneven dim 0
        assert torch.equal(hvd.allgather(rows[r], process_set=ps), torch.cat([rows[k] for k in members]))
        scattered = _inputs(members, (5, 2), 3)
        out = hvd.reducescatter(scattered[r], op=hvd.Sum, process_set=ps)
        ref = scatter_slice(reduce_ref(list(scattered.values()), "Sum"), 2, ps.rank()).float()
        assert_close(out, ref, "float32")
        assert torch.equal(hvd.broadcast(ins[r], root_rank=members[1], process_set=ps), ins[members[1]])
        sent = torch.arange(6.0) + 10 * r
        got = hvd.alltoall(sent, process_set=ps)  # 3 rows to each of the 2 ranks
        assert torch.equal(got, torch.cat([torch.arange(6.0)[3 * ps.rank():3 * ps.rank() + 3] + 10 * k
                                           for k in members]))
        grouped = hvd.grouped_allreduce([ins[r], 2 * ins[r]], op=hvd.Sum, name="g", process_set=ps)
        total = reduce_ref(list(ins.values()), "Sum").float()
        assert_close(grouped[0], total, "float32")
        assert_close(grouped[1], 2 * total, "float32")
        # Autograd over the set: the gradient of an Average allreduce is the Average of the gradients.
        x = ins[r].clone().requires_grad_()
        (hvd.allreduce(x, op=hvd.Average, name="grad", process_set=ps) * (r + 1)).sum().backward()
        assert_close(x.grad, torch.full_like(x, sum(k + 1 for k in members) / 2), "float32")
        hvd.barrier(process_set=ps)
        return ps.process_set_id
    finally:
        hvd.remove_process_set(low)
        hvd.remove_process_set(high)


def test_disjoint_sets_run_beside_the_global_set():
    ids = _pool(4).run(_disjoint_sets)
    assert ids[0] == ids[1] != ids[2] == ids[3]


# --- overlapping sets, and the same name in three sets at once ------------------------------


def _overlapping_sets():
    a, b = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])
    try:
        r = hvd.rank()
        handles = {}
        # Rank 1 submits in the order no other rank sees: b, then a, then the global set.
        for name, ps in (("b", b), ("a", a), ("all", None)):
            if ps is None or ps.included():
                t = torch.full((4,), float(r + 1))
                handles[name] = hvd.allreduce_async(t, op=hvd.Sum, name="same",
                                                    process_set=ps or hvd.global_process_set)
        got = {k: hvd.synchronize(h)[0].item() for k, h in handles.items()}
        # Many rounds of both sets, unsynchronized between rounds, to let any ordering bug deadlock.
        pending = []
        for i in range(30):
            for ps in (b, a):
                if ps.included():
                    pending.append((ps, hvd.allgather_async(torch.tensor([[r, i]]), name=f"round.{i}", process_set=ps)))
        for ps, h in pending:
            assert hvd.synchronize(h)[:, 0].tolist() == ps.ranks
        return got
    finally:
        hvd.remove_process_set(a)
        hvd.remove_process_set(b)


def test_overlapping_sets_run_concurrently_with_the_same_tensor_name():
    got = _pool(3).run(_overlapping_sets)
    assert got == [{"a": 3.0, "all": 6.0}, {"a": 3.0, "b": 5.0, "all": 6.0}, {"b": 5.0, "all": 6.0}]


# --- misuse: never a hang ------------------------------------------------------------------


def _outside_the_set():
    ps = hvd.add_process_set([0, 1])
    try:
        if ps.included():
            # A root outside the set is refused at the call on every member.
            with pytest.raises(ValueError, match=r"root_rank 2 of 'b' is not in process set \d+ \(ranks \[0, 1\]\)"):
                hvd.broadcast(torch.ones(2), root_rank=2, name="b", process_set=ps)
            return hvd.allreduce(torch.ones(2), op=hvd.Sum, name="inside", process_set=ps).tolist()
        with pytest.raises(ValueError, match=r"Rank 2 is not in ProcessSet\(process_set_id=") as rank_error:
            ps.rank()
        with pytest.raises(ValueError) as op_error:
            hvd.allreduce(torch.ones(2), name="inside", process_set=ps)
        return [str(rank_error.value), str(op_error.value)]
    finally:
        hvd.remove_process_set(ps)


def test_a_rank_outside_a_set_gets_a_clear_error_at_the_call():
    out = _pool(3).run(_outside_the_set)
    assert out[0] == out[1] == [2.0, 2.0]
    assert out[2][1].startswith("Rank 2 submitted the allreduce of 'inside' on process set "), out[2][1]
    assert "(ranks [0, 1]), which it is not in" in out[2][1]


def _changes_while_running():
    r = hvd.rank()
    errors = {}
    ps = hvd.add_process_set([0, 2])
    if ps.included():
        assert hvd.allreduce(torch.tensor([r]), op=hvd.Sum, name="t", process_set=ps).item() == 2
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None and ps.size() is None
    assert hvd.remove_process_set(ps) is False and hvd.remove_process_set(hvd.global_process_set) is False
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=ps)
    # Another set with the same ranks, and an op of the old one's name: a new tensor.
    again = hvd.add_process_set([0, 2])
    assert again.process_set_id != ps.process_set_id
    if again.included():
        assert hvd.allreduce(torch.tensor([r]), op=hvd.Sum, name="t", process_set=again).item() == 2
    # Every rank fails alike, and the job goes on.
    for what, ranks in (("duplicate", [0, 2]), ("different", [0, 1] if r == 0 else [0, 2]),
                        ("out of range", [0, 7]), ("global", [0, 1, 2])):
        with pytest.raises(ValueError) as e:
            hvd.add_process_set(ranks)
        errors[what] = str(e.value)
    hvd.remove_process_set(again)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item() == 3
    return errors


def test_sets_added_and_removed_while_the_job_runs():
    out = _pool(3).run(_changes_while_running)
    for errors in out:
        assert "exists already" in errors["duplicate"]
        assert "called differently on the ranks (rank 0: add ranks [0, 1]; rank 1: add ranks [0, 2]" \
            in errors["different"]
        assert "ranks [7] are not ranks of this job of size 3" in errors["out of range"]
        assert "exists already" in errors["global"] and "process_set_id=0" in errors["global"]


# --- the helpers ---------------------------------------------------------------------------


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _loss(model, rank):
    return model(make(rank, (8, 4), "float32", 5)).pow(2).sum()


def _helpers():
    ps = hvd.add_process_set([0, 2])
    r = hvd.rank()
    try:
        model = _model(seed=r)  # every rank starts elsewhere
        if ps.included():
            hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=ps)
            root = _model(seed=2)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), root.parameters()))
            assert hvd.broadcast_object({"from": r}, root_rank=2, process_set=ps) == {"from": 2}
            assert hvd.allgather_object(("rank", r), process_set=ps) == [("rank", 0), ("rank", 2)]
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            _loss(model, r).backward()
            opt.step()  # momentum buffers differ by rank
            hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=ps)
            ref = _model(seed=2)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            _loss(ref, 2).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])

        # DistributedOptimizer over the set: members average their gradients, rank 1 steps alone.
        model = _model(seed=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=ps)
        for _ in range(2):
            opt.zero_grad()
            _loss(model, r).backward()
            opt.step()
        ref = _model(seed=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            grads = []
            for k in (ps.ranks if ps.included() else [r]):
                ref.zero_grad()
                _loss(ref, k).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for p, *gs in zip(ref.parameters(), *grads):
                p.grad = sum(gs) / len(gs)
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), "float32")
        return [p.detach().clone() for p in model.parameters()]
    finally:
        hvd.remove_process_set(ps)


def test_helpers_and_distributed_optimizer_over_a_set():
    params = _pool(3).run(_helpers)
    assert all(torch.equal(p, q) for p, q in zip(params[0], params[2]))
    assert not all(torch.equal(p, q) for p, q in zip(params[0], params[1]))  # rank 1 trained on its own


# --- static sets, init and shutdown, and the dynamic switch --------------------------------


def _wait_for_rank0_store(rank):
    """Before init() again: these ranks' store is a server rank 0 starts at each init()
    on one fixed port (MASTER_PORT without torchrun's agent), so a rank that connects
    before rank 0 has closed the last one meets the old server."""
    if rank != 0:
        time.sleep(1.0)


def _static_sets():
    result = {}
    a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 1])
    assert (a.process_set_id, a.size(), a.rank(), b.ranks) == (None, None, None, [1, 2])
    hvd.init(process_sets=[a, b])
    r = hvd.rank()
    result["plane"] = hvd.runtime_info()["control_plane"]
    result["str"] = [str(hvd.global_process_set), str(a), str(b)]
    for name, ps in (("a", a), ("b", b)):
        if ps.included():
            result[name] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="x", process_set=ps).item()
    for call in (lambda: hvd.add_process_set([0, 2]), lambda: hvd.remove_process_set(a)):
        with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1") as e:
            call()
        result.setdefault("refused", []).append(str(e.value))
    hvd.barrier()  # a rank's shutdown stops every rank, set members' ops too
    hvd.shutdown()
    assert a.process_set_id is None and b.process_set_id is None  # sets belong to one init()
    # Ranks that pass different sets to init() all fail, and stay uninitialized.
    _wait_for_rank0_store(r)
    with pytest.raises(ValueError, match="called differently") as e:
        hvd.init(process_sets=[a] if r == 0 else [a, b])
    result["mismatch"] = str(e.value)
    assert not hvd.is_initialized()
    _wait_for_rank0_store(r)
    hvd.init(process_sets="dynamic")
    c = hvd.add_process_set([0, 2])
    if c.included():
        result["c"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="x", process_set=c).item()
    hvd.barrier()
    hvd.shutdown()
    return result


def test_static_sets_in_init_and_dynamic_sets_only_when_asked():
    # Negotiation over Gloo here (the pools above use shared memory): each set's over a Gloo group of its own.
    out = launch(_static_sets, 3, env={"HOROVOD_ZERO_SHM_CONTROL": "0"}, timeout=180)
    assert sorted(out) == [0, 1, 2] and all(status == "ok" for status, _ in out.values()), "\n".join(str(v) for v in out.values())
    res = [out[k][1] for k in range(3)]
    assert res[0]["plane"] == "gloo"
    assert res[0]["str"] == ["ProcessSet(process_set_id=0, ranks=[0, 1, 2])",
                             "ProcessSet(process_set_id=1, ranks=[0, 1])",
                             "ProcessSet(process_set_id=2, ranks=[1, 2])"]
    assert [x.get("a") for x in res] == [1.0, 1.0, None] and [x.get("b") for x in res] == [None, 3.0, 3.0]
    assert [x.get("c") for x in res] == [2.0, None, 2.0]
    assert "rank 0: 1 process sets in hvd.init(); rank 1: 2 process sets" in res[0]["mismatch"]
