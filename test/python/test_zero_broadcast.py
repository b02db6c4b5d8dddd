"""hvd.broadcast_optimizer_state() of a DistributedZeroOptimizer, in Horovod's idioms with
only the wrapper changed: the boilerplate broadcast after wrapping (Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py), and "rank 0 loads a checkpoint, then
broadcasts". Each run is checked against plain torch on the whole batch in one process,
as Horovod's DistributedOptimizer would train; stages 1-3, CPU and NVMe offload, and
hybrid sharding. The GPU tests (test/gpu/test_gpu_zero_broadcast.py) run the same workers
with device="cuda"."""

import functools

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch
from refs import STEPS, adamw, batch, mlp, mse, rank_rows, rel_err, train_reference

RESUME_AT = 2  # steps in the checkpoint; the job trains the other STEPS - RESUME_AT


def _on(device):
    return hvd.device() if device == "cuda" else torch.device(device)


def _train(model, opt, steps, start=0):
    n, r = hvd.size(), hvd.rank()
    dev = opt.sharded_state.device
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(step, 0, dev)
        mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        opt.step()


def _weights(model, opt):
    if opt.stage == 3:
        with opt.gathered_params():
            return [p.detach().double().clone() for p in model.parameters()]
    return [p.detach().double().clone() for p in model.parameters()]


def _errs(model, opt, ref):
    return [rel_err(p, q) for p, q in zip(_weights(model, opt), ref.parameters())]


# --- the boilerplate broadcast: pytorch_synthetic_benchmark.py's lines, ZeRO's wrapper -----

def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)


def _synthetic_benchmark(stage, device="cpu"):
    """The script's setup, then its steps; half way, the broadcast again (each rank holds its
    shard of the state now, so only the hyperparameters move)."""
    model = mlp(seed=10 + hvd.rank(), device=_on(device))  # every rank's initial weights differ; rank 0's win
    optimizer = _sgd(model)
    optimizer = hvd.DistributedZeroOptimizer(optimizer, model=model, stage=stage)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    fresh = not optimizer.state
    _train(model, optimizer, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    _train(model, optimizer, STEPS - 2, start=2)
    ref = mlp(seed=10)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    train_reference(1, None, model=ref, opt=ref_opt)
    return fresh, _errs(model, optimizer, ref)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_horovods_boilerplate_broadcast_works_with_zero(ranks, stage):
    for fresh, errs in ranks.run(_synthetic_benchmark, stage):
        assert fresh, "a broadcast from a root with nothing to give created state"
        assert max(errs) < 1e-5, errs


# --- rank 0 loads a checkpoint, then broadcasts ------------------------------------------

def _horovod_checkpoint(source, device):
    """What rank 0 reads: a Horovod (plain torch) job's {"model", "optimizer"} state dicts after
    RESUME_AT steps, or (source="consolidated") a ZeRO job's hvd.zero.consolidated_state_dict."""
    if source == "torch":
        model, opt = train_reference(1, None, steps=RESUME_AT)
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}, opt
    model = mlp(device=_on(device))
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2)
    _train(model, opt, RESUME_AT)
    ckpt = hvd.zero.consolidated_state_dict(model, opt)  # every rank; rank 0 gets it
    _, ref_opt = train_reference(1, None, steps=RESUME_AT)
    return ckpt, ref_opt


def _full_state_by_shard(view, ref_opt):
    """The plain optimizer's state of each shard's parameter (its own order is the model's)."""
    params = [p for g in ref_opt.param_groups for p in g["params"]]
    names = dict(zip(params, [n for n, _ in mlp().named_parameters() if n.endswith("weight")] +
                     [n for n, _ in mlp().named_parameters() if n.endswith("bias")]))
    by_name = {names[p]: ref_opt.state[p] for p in params}
    return [by_name[s.name] for s in view.shards]


def _shards_match(opt, ref_opt, exact):
    """Whether this rank's state is its slice of the plain optimizer's full state (exactly, or
    to fp32 rounding for a ZeRO job's state)."""
    same = torch.equal if exact else functools.partial(torch.allclose, rtol=1e-4, atol=1e-9)
    view = opt.sharded_state
    with view.materialized():
        for s, mp, full in zip(view.shards, view.masters, _full_state_by_shard(view, ref_opt)):
            mine = view.inner.state.get(mp, {})
            if set(mine) != set(full) or float(mine["step"]) != float(full["step"]):
                return False
            lo, hi = s.my_range(view.rank)
            for key in ("exp_avg", "exp_avg_sq"):
                if not same(mine[key][:hi - lo].cpu(), full[key].reshape(-1)[lo:hi]):
                    return False
    groups = [{k: v for k, v in g.items() if k not in ("params", "foreach", "fused")} for g in opt.param_groups]
    ref_groups = [{k: v for k, v in g.items() if k not in ("params", "foreach", "fused")}
                  for g in ref_opt.param_groups]
    return groups == ref_groups


def _resume_after_broadcast(stage, source, where=None, nvme_path=None, launched=False, device="cpu"):
    if launched:
        hvd.init()
    r = hvd.rank()
    kwargs = dict(where or {})
    if nvme_path:
        kwargs.update(offload_optimizer="nvme", nvme_path=nvme_path)
    if stage == 3:
        kwargs["units"] = [torch.nn.Linear]
    ckpt, ref_opt = _horovod_checkpoint(source, device)
    model = mlp(seed=20 + r, device=_on(device))  # rank 0's weights come from the checkpoint, the others' are wrong
    if r == 0 and stage == 3:
        model.load_state_dict(ckpt["model"])  # stage 3's parameters are shards at rest: load before wrapping
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage, **kwargs)
    for g in opt.param_groups:  # each rank's hyperparameters differ, too
        g["lr"] *= 1 + r
    if r == 0:
        if stage < 3:
            model.load_state_dict(ckpt["model"])  # Horovod's idiom: into the model after wrapping
        opt.load_state_dict(ckpt["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    matches = _shards_match(opt, ref_opt, exact=source == "torch")
    _train(model, opt, STEPS - RESUME_AT, start=RESUME_AT)
    ref, _ = train_reference(1, None, steps=STEPS)
    out = matches, _errs(model, opt, ref)
    if launched:
        hvd.barrier()
        hvd.shutdown()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("source", ["torch", "consolidated"])
def test_rank_0_loads_a_checkpoint_then_broadcasts(ranks, stage, source):
    for matches, errs in ranks.run(_resume_after_broadcast, stage, source):
        assert matches, "a rank's optimizer state is not its shard of the root's"
        assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_0_loads_a_checkpoint_then_broadcasts_with_cpu_offload(ranks, stage):
    for matches, errs in ranks.run(_resume_after_broadcast, stage, "torch", dict(offload_optimizer="cpu")):
        assert matches and max(errs) < 1e-5, errs


def test_rank_0_loads_a_checkpoint_then_broadcasts_with_nvme_offload(tmp_path):
    res = launch(_resume_after_broadcast, 2, 2, "torch", None, str(tmp_path), True, timeout=180)
    assert sorted(res) == [0, 1] and all(s == "ok" for s, _ in res.values()), res
    for _, (matches, errs) in res.values():
        assert matches and max(errs) < 1e-5, errs


def _node_env(rank, local):
    return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local)}


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_0_loads_a_checkpoint_then_broadcasts_with_hybrid_sharding(stage):
    res = launch(_resume_after_broadcast, 4, stage, "torch", dict(shard_group="node"), None, True,
                 env=functools.partial(_node_env, local=2), timeout=180)
    assert sorted(res) == [0, 1, 2, 3] and all(s == "ok" for s, _ in res.values()), res
    for _, (matches, errs) in res.values():
        assert matches and max(errs) < 1e-5, errs


# --- what is refused -------------------------------------------------------------------

def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _root_without_state_but_another_rank_with():
    """Only rank 1 loads a full state: the root (0) has none to give, and the ranks differ."""
    model = mlp()
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2)
    if hvd.rank() == 1:
        _, ref_opt = train_reference(1, None, steps=1)
        opt.load_state_dict(ref_opt.state_dict())
    return _error(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0))


def test_ranks_whose_sharded_states_differ_are_refused_on_every_rank(ranks):
    for msg in ranks.run(_root_without_state_but_another_rank_with):
        assert msg is not None and "sharded states differ" in msg and "rank 1: 0 steps, a loaded full state" in msg, msg


def _unfit_states():
    model = mlp()
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2)
    _, ref_opt = train_reference(1, None, steps=1)
    sgd = torch.optim.SGD([{"params": g["params"]} for g in ref_opt.param_groups], lr=0.1, momentum=0.9)
    for p in ref_opt.state:
        sgd.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    return {"groups": _error(lambda: opt.load_state_dict(torch.optim.AdamW(mlp().parameters()).state_dict())),
            "class": _error(lambda: opt.load_state_dict(sgd.state_dict())),
            "consolidated": _error(lambda: opt.load_state_dict({"model": {}, "optimizer": {}, "zero": {}})),
            "wrong_root": _error(lambda: hvd.broadcast_optimizer_state(opt, root_rank=hvd.size()))}


def test_states_that_do_not_fit_are_refused_before_anything_is_loaded(ranks):
    for msgs in ranks.run(_unfit_states):
        assert "param groups of [4] parameters" in msgs["groups"], msgs
        assert "Optimizer state does not carry over between optimizer classes" in msgs["class"], msgs
        assert "hvd.zero.load_consolidated" in msgs["consolidated"], msgs
        assert "is not one of the optimizer's ranks" in msgs["wrong_root"], msgs
