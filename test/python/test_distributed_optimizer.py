"""hvd.DistributedOptimizer against single-process torch: every rank trains on a
batch of its own; the reference trains one copy of the model on all ranks' batches
at once (for Average, the mean loss over the concatenated batch), with the same
torch optimizer. SGD, not Adam: Adam would hide a gradient that is off by a factor."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from refs import make

STEPS = 3


def _model(dtype=torch.float64, unused_branch=False):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"l1": torch.nn.Linear(5, 8), "l2": torch.nn.Linear(8, 3)})
        if unused_branch:
            model["extra"] = torch.nn.Linear(8, 3)
    return model.to(dtype)


def _forward(model, x, k=0):
    h = torch.tanh(model["l1"](x))
    out = model["l2"](h)
    if "extra" in model and k == 0:  # only rank 0 uses this layer
        out = out + model["extra"](h)
    return out


def _batch(k, step, micro=0, dtype="float64"):
    seed = 10 * step + micro
    return make(k, (4, 5), dtype, seed), make(k, (4, 3), dtype, seed + 5)


def _loss(model, k, step, micro=0, dtype="float64"):
    x, y = _batch(k, step, micro, dtype)
    return F.mse_loss(_forward(model, x, k), y)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _max_diff(model, ref):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


def _train(passes=1, op="Average", dtype=torch.float64, unused_branch=False, **kwargs):
    """Trains ours and the reference for STEPS steps; returns the largest parameter difference."""
    n, r = hvd.size(), hvd.rank()
    model = _model(dtype, unused_branch)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), op=getattr(hvd, op),
                                   backward_passes_per_step=passes, **kwargs)
    ref_opt = _sgd(ref)
    dt = str(dtype).split(".")[1]
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(passes):
            _loss(model, r, step, m, dt).backward()
        opt.step()
        # The gradient Horovod applies: per pass summed, over ranks averaged (or summed).
        ref_opt.zero_grad()
        total = sum(_loss(ref, k, step, m, dt) for k in range(n) for m in range(passes))
        (total / n if op == "Average" else total).backward()
        ref_opt.step()
    return _max_diff(model, ref)


def _train_with(kwargs):
    return _train(**kwargs)  # RankPool.run passes positional arguments only


def test_average_matches_single_process_training_on_the_concatenated_batch(ranks):
    assert max(ranks.run(_train)) < 1e-12


def test_sum_op_matches_the_summed_losses(ranks):
    assert max(ranks.run(_train_with, dict(op="Sum"))) < 1e-12


def test_gradient_predivide_factor_still_averages(ranks):
    # Prescale 1/f before the sum, postscale f/size after: the average again.
    assert max(ranks.run(_train_with, dict(gradient_predivide_factor=4.0))) < 1e-12


def test_parameter_unused_on_one_rank_is_reduced_with_zeros_there(ranks):
    assert max(ranks.run(_train_with, dict(unused_branch=True))) < 1e-12


def test_groups_reduce_parameters_together_with_the_same_result(ranks):
    assert max(ranks.run(_train_with, dict(groups=2))) < 1e-12


def _train_with_listed_groups():
    model = _model()
    ref = copy.deepcopy(model)
    n, r = hvd.size(), hvd.rank()
    groups = [[model["l1"].weight, model["l2"].bias]]  # the other two: a group each
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), groups=groups)
    ref_opt = _sgd(ref)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, r, step).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(_loss(ref, k, step) for k in range(n)) / n).backward()
        ref_opt.step()
    return _max_diff(model, ref)


def test_groups_given_as_lists_of_parameters(ranks):
    assert max(ranks.run(_train_with_listed_groups)) < 1e-12


def _accumulation_reduces_once_per_step():
    hvd.collective_stats(reset=True)
    diff = _train(passes=2)
    reduced = sum(s["tensors"] for s in hvd.collective_stats() if s["op"] == "allreduce")
    return diff, reduced


def test_backward_passes_per_step_accumulates_locally_then_reduces_once(ranks):
    for diff, reduced in ranks.run(_accumulation_reduces_once_per_step):
        assert diff < 1e-12
        assert reduced == STEPS * 4, f"{reduced} gradient allreduces for {STEPS} steps of 4 parameters"


def _fp16_compression():
    hvd.collective_stats(reset=True)
    diff = _train(dtype=torch.float32, compression=hvd.Compression.fp16)
    wire = {s["dtype"] for s in hvd.collective_stats() if s["op"] == "allreduce"}
    return diff, wire


def test_fp16_compression_sends_float16_and_stays_close(ranks):
    for diff, wire in ranks.run(_fp16_compression):
        assert wire == {"float16"}, wire
        assert diff < 2e-3, diff


def _clip_between_synchronize_and_step():
    """Horovod's documented pattern: synchronize(), clip, step() in skip_synchronize()."""
    n, r = hvd.size(), hvd.rank()
    model = _model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    ref_opt = _sgd(ref)
    max_norm, norms = 0.05, []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pattern must not warn
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, r, step).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with opt.skip_synchronize():
                opt.step()
            ref_opt.zero_grad()
            (sum(_loss(ref, k, step) for k in range(n)) / n).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
            ref_opt.step()
    return _max_diff(model, ref), min(norms) > max_norm


def test_synchronize_clip_then_step_in_skip_synchronize(ranks):
    for diff, clipped in ranks.run(_clip_between_synchronize_and_step):
        assert clipped, "the gradients were never large enough to be clipped"
        assert diff < 1e-12


# Horovod 0.28's words (horovod/torch/optimizer.py, _DistributedOptimizer.step).
HOROVOD_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                        "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                        "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def _step_after_synchronize_warns():
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    _loss(model, hvd.rank(), 0).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    # A filter written for Horovod's warning silences ours.
    opt.zero_grad()
    _loss(model, hvd.rank(), 1).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as filtered:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=r"optimizer\.step\(\) called without optimizer\.skip_synchronize")
        opt.step()
    return [(w.category, str(w.message), w.filename) for w in caught], len(filtered)


def test_step_after_synchronize_without_skip_synchronize_warns_as_horovod_does(ranks):
    for caught, filtered in ranks.run(_step_after_synchronize_warns):
        assert [(c, m) for c, m, _ in caught] == [(UserWarning, HOROVOD_STEP_WARNING)], caught
        assert caught[0][2] == __file__, caught  # it points at the step() call
        assert filtered == 0


def _horovod_attributes(named):
    """The attributes of Horovod's _DistributedOptimizer that scripts read, after one backward."""
    model = _model()
    groups = [{"params": list(model["l1"].parameters())}, {"params": list(model["l2"].parameters()), "lr": 0.05}]
    kwargs = dict(named_parameters=model.named_parameters()) if named else {}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1), backward_passes_per_step=2, **kwargs)
    _loss(model, hvd.rank(), 0).backward()
    names = {n: p for n, p in model.named_parameters()}
    return ({k: _name_of(names, p) for p, k in opt._parameter_names.items()},
            {_name_of(names, p): d for p, d in opt._allreduce_delay.items()},
            sorted(_name_of(names, p) for p in opt._requires_update),
            (opt.backward_passes_per_step, opt.op == hvd.Average, opt.gradient_predivide_factor, opt.sparse_as_dense,
             opt.process_set == hvd.global_process_set, opt._compression is hvd.Compression.none,
             opt._should_synchronize, opt._synchronized))


def _name_of(names, p):
    return next(n for n, q in names.items() if q is p)


@pytest.mark.parametrize("named", [True, False], ids=["named_parameters", "no_names"])
def test_keeps_the_attributes_of_horovods_distributed_optimizer(ranks, named):
    params = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    # Without named_parameters Horovod 0.28 names them allreduce.noname.<group>.<index>.
    expected = {n: n for n in params} if named else {
        "allreduce.noname.0.0": "l1.weight", "allreduce.noname.0.1": "l1.bias",
        "allreduce.noname.1.0": "l2.weight", "allreduce.noname.1.1": "l2.bias"}
    for names, delay, requires_update, plain in ranks.run(_horovod_attributes, named):
        assert names == expected, names
        assert delay == {n: 1 for n in params}, delay  # one of the two backward passes done
        assert requires_update == sorted(params), requires_update
        assert plain == (2, True, 1.0, False, True, True, True, False), plain


def _sparse_embedding_training(sparse_as_dense):
    """nn.Embedding(sparse=True) against a dense embedding trained on all ranks' tokens."""
    n, r = hvd.size(), hvd.rank()
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4, sparse=True), "out": torch.nn.Linear(4, 1)})
    model = model.double()
    ref = copy.deepcopy(model)
    ref["emb"].sparse = False
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def loss(m, k, step):
        g = torch.Generator().manual_seed(100 * step + k)
        tokens = torch.randint(0, 10, (6,), generator=g)  # ranks touch different rows, some the same
        return (m["out"](m["emb"](tokens)).squeeze(1) - tokens.double() / 10).pow(2).mean()

    grad_sparse = []
    for step in range(STEPS):
        opt.zero_grad()
        loss(model, r, step).backward()
        opt.synchronize()
        grad_sparse.append(model["emb"].weight.grad.is_sparse)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        (sum(loss(ref, k, step) for k in range(n)) / n).backward()
        ref_opt.step()
    return _max_diff(model, ref), all(grad_sparse)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["allgathered", "sparse_as_dense"])
def test_sparse_embedding_gradients_match_a_dense_reference(ranks, sparse_as_dense):
    for diff, stayed_sparse in ranks.run(_sparse_embedding_training, sparse_as_dense):
        assert stayed_sparse, "the optimizer should still see a sparse gradient"
        assert diff < 1e-12


def _misuse_is_refused():
    model = _model()
    msgs = {}
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    _loss(model, hvd.rank(), 0).backward()
    try:
        opt.zero_grad()
    except AssertionError as e:
        msgs["zero_grad_before_step"] = str(e)
    try:
        _loss(model, hvd.rank(), 1).backward()
    except AssertionError as e:
        msgs["too_many_passes"] = str(e)
    opt.synchronize()  # the first pass's reductions are in flight on every rank
    opt.zero_grad()
    for key, kwargs in {"adasum": dict(op=hvd.Adasum), "predivide_sum": dict(op=hvd.Sum, gradient_predivide_factor=2.0),
                        "duplicate_names": dict(named_parameters=[("w", p) for p in model.parameters()]),
                        "unnamed": dict(named_parameters=list(model.named_parameters())[:1])}.items():
        try:
            hvd.DistributedOptimizer(_sgd(model), **kwargs)
        except (ValueError, NotImplementedError) as e:
            msgs[key] = f"{type(e).__name__}: {e}"
    return msgs


def test_misuse_is_refused_with_what_to_do(ranks):
    for msgs in ranks.run(_misuse_is_refused):
        assert "Call step() or synchronize() first" in msgs["zero_grad_before_step"], msgs
        assert "larger backward_passes_per_step" in msgs["too_many_passes"], msgs
        assert msgs["adasum"].startswith("NotImplementedError") and "op=hvd.Average" in msgs["adasum"], msgs
        assert "needs op=hvd.Average" in msgs["predivide_sum"], msgs
        assert "names must be unique" in msgs["duplicate_names"], msgs
        assert "does not name the optimizer's parameters" in msgs["unnamed"], msgs


def _scheduler_and_state_dict():
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # needs isinstance(opt, Optimizer)
    _loss(model, hvd.rank(), 0).backward()
    opt.step()
    sched.step()
    inner = opt.optimizer
    fresh = _sgd(_model())
    fresh.load_state_dict(opt.state_dict())
    return (opt.param_groups is inner.param_groups, opt.state is inner.state, inner.param_groups[0]["lr"],
            fresh.param_groups[0]["lr"], len(fresh.state))


def test_wraps_the_optimizer_and_works_with_lr_schedulers(ranks):
    for shared_groups, shared_state, lr, loaded_lr, loaded_state in ranks.run(_scheduler_and_state_dict):
        assert shared_groups and shared_state
        assert lr == loaded_lr == pytest.approx(0.05)
        assert loaded_state == 4  # a momentum buffer per parameter came through state_dict()
