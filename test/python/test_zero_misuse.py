"""DistributedZeroOptimizer under misuse that used to train silently wrong, hang, or
fail with a message that did not say what went wrong: each case now raises an error
that says what to do, or works, checked against single-process torch. 2 CPU ranks."""

import io
import time

import pytest
import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from harness import shared_pool

BATCH = 8  # global batch; each of the 2 ranks takes half


@pytest.fixture
def two_ranks():
    return shared_pool(2)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 5, generator=g)


def _local(t):
    k = t.shape[0] // hvd.size()
    return t[hvd.rank() * k:(hvd.rank() + 1) * k]


def _train(model, opt, steps, start=0, zero=True):
    """zero=False: the single-process reference, on the whole batch."""
    for step in range(start, start + steps):
        x, y = _data(step)
        if zero:
            x, y = _local(x), _local(y)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _max_err(model, ref):
    return max(float((p.detach().double() - q.detach().double()).abs().max())
               for p, q in zip(model.parameters(), ref.parameters()))


def _error(fn):
    """The message of what fn() raised (its type too), or None."""
    try:
        fn()
    except Exception as e:  # the tests check the message, so a wrong error fails them too
        return f"{type(e).__name__}: {e}"
    return None


def _groups(model, reverse=False):
    """Weights and biases with their own hyperparameters; reverse: the groups, and the
    parameters within each, in the opposite order."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "lr": 1e-2, "weight_decay": 0.1}, {"params": biases, "lr": 3e-2, "weight_decay": 0.0}]
    return [dict(g, params=g["params"][::-1]) for g in groups[::-1]] if reverse else groups


def _save(form, model, opt):
    return hvd.zero.consolidated_state_dict(model, opt) if form == "consolidated" else opt.state_dict()


def _load(form, state, model, opt):
    if form == "consolidated":
        hvd.zero.load_consolidated(state, model, opt)
    else:
        opt.load_state_dict(state)


# --- 1. param groups added after wrapping ------------------------------------

def _inner_add_param_group():
    model = _model()
    model[2].requires_grad_(False)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2), model=model)
    _train(model, opt, 1)
    model[2].requires_grad_(True)
    opt.optimizer.add_param_group({"params": list(model[2].parameters())})
    return _error(lambda: _train(model, opt, 1, start=1))


def test_a_group_added_to_the_inner_optimizer_is_refused_at_step(two_ranks):
    for msg in two_ranks.run(_inner_add_param_group):
        assert msg is not None, "a group added behind the wrapper's back was stepped silently"
        assert "add_param_group()" in msg and "before wrapping" in msg, msg


def _unfreeze_later(model, make_opt, zero):
    """2 steps with the last layer frozen and outside the optimizer, then 2 with it added."""
    model[2].requires_grad_(False)
    opt = make_opt(model[0].parameters())
    _train(model, opt, 2, zero=zero)
    model[2].requires_grad_(True)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 5e-3, "weight_decay": 0.0})
    _train(model, opt, 2, start=2, zero=zero)
    return opt


def _zero_add_param_group(stage, overlap):
    model = _model()
    opt = _unfreeze_later(model, lambda ps: hvd.DistributedZeroOptimizer(
        torch.optim.AdamW(ps, lr=1e-2), model=model, stage=stage, overlap_param_gather=overlap), zero=True)
    opt.wait_for_params()
    ref = _model()
    _unfreeze_later(ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2), zero=False)
    added = opt.param_groups[1]["params"]
    return _max_err(model, ref), [opt.state[p]["exp_avg"].numel() for p in added]


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True)])
def test_add_param_group_on_the_wrapper_shards_the_group(two_ranks, stage, overlap):
    for err, added_state in two_ranks.run(_zero_add_param_group, stage, overlap):
        assert err < 1e-6, err
        assert added_state == [33, 3], added_state  # 65 and 5 elements, sharded over 2 ranks


# --- 2. parameters replaced after wrapping ------------------------------------

def _replaced_after_wrapping(kind):
    model = _model()
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                       param_dtype=torch.bfloat16 if kind == "float" else None)
    if kind in ("float", "unchanged"):
        model.float()  # "unchanged": already fp32, so nothing is replaced
    elif kind == "half":
        model.half()
    elif kind == "parameter":
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    dtype = model[0].weight.dtype
    x, y = _data(0)

    def step():
        F.mse_loss(model(_local(x).to(dtype)).float(), _local(y)).backward()
        opt.step()
    return _error(step)


@pytest.mark.parametrize("kind", ["float", "half", "parameter", "unchanged"])
def test_replacing_a_parameter_after_wrapping_is_refused_by_name(two_ranks, kind):
    for msg in two_ranks.run(_replaced_after_wrapping, kind):
        if kind == "unchanged":
            assert msg is None, msg
            continue
        assert msg is not None, f"model changed by {kind!r} after wrapping stopped training silently"
        assert "Parameter '0.weight'" in msg, msg
        assert ("param_dtype=" in msg) if kind != "parameter" else ("before building and wrapping" in msg), msg


# --- 3. param groups built in another order than saved -------------------------

def _resume_with_groups(form, build):
    named = build != "unnamed"
    model = _model()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(_groups(model)), model=model if named else None)
    _train(model, opt, 2)
    state = _save(form, model if named else None, opt)
    model2 = _model(seed=7)  # other weights: the checkpoint must replace them
    if build == "regrouped":  # by layer instead of weights / biases: cannot be matched
        groups = [{"params": list(model2[0].parameters())}, {"params": list(model2[2].parameters())}]
    else:
        groups = _groups(model2, reverse=True)
    opt2 = hvd.DistributedZeroOptimizer(torch.optim.AdamW(groups), model=model2 if named else None)
    msg = _error(lambda: _load(form, state, model2 if named else None, opt2))
    if msg is not None:
        return msg, None
    _train(model2, opt2, 2, start=2)
    ref = _model()
    _train(ref, torch.optim.AdamW(_groups(ref)), 4, zero=False)
    return None, _max_err(model2, ref)


@pytest.mark.parametrize("form", ["consolidated", "per_rank"])
def test_groups_in_another_order_are_matched_by_name(two_ranks, form):
    for msg, err in two_ranks.run(_resume_with_groups, form, "reordered"):
        assert msg is None, msg
        assert err < 1e-6, err


@pytest.mark.parametrize("form", ["consolidated", "per_rank"])
@pytest.mark.parametrize("build,fragment", [("regrouped", "matches no param group"), ("unnamed", "pass model=")])
def test_groups_that_cannot_be_matched_are_refused(two_ranks, form, build, fragment):
    for msg, _ in two_ranks.run(_resume_with_groups, form, build):
        assert msg is not None, "groups that do not match were loaded"
        assert fragment in msg, msg


# --- 4. state of another optimizer class ----------------------------------------

def _make(cls, model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2) if cls == "AdamW" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _other_optimizer_class(form):
    out = {}
    for saved, target in (("AdamW", "SGD"), ("SGD", "AdamW")):
        model = _model()
        opt = hvd.DistributedZeroOptimizer(_make(saved, model), model=model)
        _train(model, opt, 1)
        state = _save(form, model, opt)
        model2 = _model()
        opt2 = hvd.DistributedZeroOptimizer(_make(target, model2), model=model2)
        out[f"{saved}->{target}"] = _error(lambda: (_load(form, state, model2, opt2), _train(model2, opt2, 1)))
    return out


@pytest.mark.parametrize("form", ["consolidated", "per_rank"])
def test_state_of_another_optimizer_class_is_refused(two_ranks, form):
    for msgs in two_ranks.run(_other_optimizer_class, form):
        for key, msg in msgs.items():
            assert msg is not None, f"{key} was accepted"
            saved, target = key.split("->")
            assert f"optimizer class {saved}" in msg and f"this optimizer is of class {target}" in msg, msg


# --- 5. the fp16 loss scale in checkpoints ------------------------------------------

def _fp16(model):
    return hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), model=model,
                                        param_dtype=torch.float16)


def _loss_scale_round_trip():
    model = _model()
    opt = _fp16(model)
    for step in range(4):
        x, y = _data(step)
        loss = F.mse_loss(model(_local(x).half()).float(), _local(y))
        if step == 0 and hvd.rank() == 1:
            loss = loss * 1e9  # fp16 gradients overflow here: every rank skips the step, the scale backs off
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    consolidated = hvd.zero.consolidated_state_dict(model, opt)
    if consolidated is not None:  # through a file's bytes, as save_checkpoint writes it
        buf = io.BytesIO()
        torch.save(consolidated, buf)
        consolidated = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    restored = {}
    for form, state in (("consolidated", consolidated), ("per_rank", opt.state_dict())):
        model2 = _model()
        opt2 = _fp16(model2)
        _load(form, state, model2, opt2)
        restored[form] = opt2.loss_scaler.state_dict()
    return opt.loss_scaler.state_dict(), restored


def test_the_loss_scale_survives_both_checkpoint_forms(two_ranks):
    for saved, restored in two_ranks.run(_loss_scale_round_trip):
        assert saved == {"scale": 2.0 ** 15, "clean_steps": 3}, saved
        assert restored == {"consolidated": saved, "per_rank": saved}, restored


# --- 6. a checkpoint that rank 0 cannot read or write --------------------------------

def _rank0_fails(action, path):
    model = _model()
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    start = time.monotonic()
    if action == "save":
        msg = _error(lambda: hvd.zero.save_checkpoint(path, model, opt, format="consolidated"))
    else:
        msg = _error(lambda: hvd.zero.load_checkpoint(path, model, opt))
    return msg, time.monotonic() - start


@pytest.mark.parametrize("case,fragment", [("missing", "no checkpoint at"), ("corrupt", "failed with"),
                                           ("not_a_checkpoint", "not a consolidated checkpoint"),
                                           ("unwritable", "could not write")])
def test_a_checkpoint_rank_0_cannot_use_fails_on_every_rank_at_once(two_ranks, tmp_path, case, fragment):
    path = str(tmp_path / ("no_such_folder/ckpt.pt" if case == "unwritable" else "ckpt.pt"))
    if case == "corrupt":
        with open(path, "wb") as f:
            f.write(b"these bytes are no torch.save archive" * 100)
    elif case == "not_a_checkpoint":
        torch.save({"weights": torch.zeros(3)}, path)
    results = two_ranks.run(_rank0_fails, "save" if case == "unwritable" else "load", path, timeout=60)
    for rank, (msg, seconds) in enumerate(results):
        assert msg is not None, f"rank {rank} did not raise"
        assert ("No rank loads" if case == "missing" else "Rank 0 could not") in msg and fragment in msg, (rank, msg)
        assert seconds < 20, (rank, seconds)


# --- 7. optimizers that create state in their constructor -----------------------------

def _adagrad(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.Adagrad([{"params": weights, "lr": 0.05, "weight_decay": 0.01},
                                {"params": biases, "lr": 0.1, "lr_decay": 0.01}], initial_accumulator_value=0.1)


def _adagrad_matches(stage):
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adagrad(model), model=model, stage=stage)
    _train(model, opt, 4)
    ref = _model()
    _train(ref, _adagrad(ref), 4, zero=False)
    return _max_err(model, ref), sorted(st["sum"].numel() for st in opt.state.values())


@pytest.mark.parametrize("stage", [1, 2])
def test_adagrad_state_made_by_its_constructor_is_rebuilt_for_the_shards(two_ranks, stage):
    for err, sums in two_ranks.run(_adagrad_matches, stage):
        assert err < 1e-6, err
        assert sums == [3, 7, 33, 52], sums  # 5, 13, 65 and 104 elements over 2 ranks


def _stepped_adagrad():
    model = _model()
    inner = _adagrad(model)
    _train(model, inner, 1, zero=False)
    return _error(lambda: hvd.DistributedZeroOptimizer(inner, model=model))


def test_an_optimizer_that_has_stepped_is_still_refused(two_ranks):
    for msg in two_ranks.run(_stepped_adagrad):
        assert msg is not None and "before its first step" in msg and "taken steps" in msg, msg


# --- 8. forward inputs cast to param_dtype ----------------------------------------------

class _Recorder(torch.nn.Module):
    """Takes keyword and nested inputs; records the dtypes its forward sees."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, extra):
        self.seen = {"x": x.dtype, "scale": extra["scale"].dtype, "ids": extra["ids"].dtype,
                     "pair": extra["pair"][0].dtype}
        return self.net(x) * extra["scale"] + extra["pair"][0] + extra["ids"].sum()


def _inputs(dtype):
    x, _ = _data(0)
    return x.to(dtype), {"scale": torch.tensor(0.5, dtype=dtype), "ids": torch.arange(5),
                         "pair": (torch.full((5,), 0.25, dtype=dtype), 3)}


def _forward_inputs(cast):
    model = _Recorder()
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                       param_dtype=torch.bfloat16, cast_forward_inputs=cast)
    x, extra = _inputs(torch.float32)
    out = []
    msg = _error(lambda: out.append(model(x, extra=extra)))
    if msg is None:
        out[0].float().sum().backward()
        opt.step()
    ref = _Recorder().bfloat16()
    x_ref, extra_ref = _inputs(torch.bfloat16)
    with torch.no_grad():
        expected = ref(x_ref, extra=extra_ref)
    return msg, model.seen, bool(out) and torch.equal(out[0].detach(), expected)


def test_fp32_inputs_are_cast_to_param_dtype(two_ranks):
    for msg, seen, same in two_ranks.run(_forward_inputs, True):
        assert msg is None, msg
        assert seen == {"x": torch.bfloat16, "scale": torch.bfloat16, "ids": torch.int64, "pair": torch.bfloat16}
        assert same, "the output differs from a bf16 model's on bf16 inputs"


def test_cast_forward_inputs_false_leaves_inputs_alone(two_ranks):
    for msg, seen, same in two_ranks.run(_forward_inputs, False):
        assert seen["x"] == torch.float32 and seen["scale"] == torch.float32, seen
        assert msg is not None and not same  # a bf16 Linear refuses fp32 inputs


# --- 9. torch.amp.GradScaler --------------------------------------------------------------

def _grad_scaler():
    model = _model()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    x, y = _data(0)
    scaler.scale(F.mse_loss(model(_local(x)), _local(y))).backward()
    msg = _error(lambda: scaler.step(opt))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step()  # the gradients already reduced are used up: the job goes on
    return msg, unchanged


def test_grad_scaler_is_refused_with_the_built_in_loss_scaling_named(two_ranks):
    for msg, unchanged in two_ranks.run(_grad_scaler):
        assert msg is not None and "GradScaler" in msg and "loss_scaler=" in msg and "scale_loss" in msg, msg
        assert unchanged


def _rewrapped(stage, overlap):
    """A second optimizer over the same model after the first is dropped (to change its
    settings, say): the first must let go of the model at once, with its hooks, without
    waiting for the cycle collector, or its gradient hooks would take the gradients first
    and the new optimizer would never train."""
    import gc
    gc.disable()  # a collection would hide an optimizer kept alive by a reference cycle
    try:
        model = _model()
        units = {"units": [torch.nn.Linear]} if stage == 3 else {}
        hooks_before = _hook_count(model)
        opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=stage,
                                           overlap_param_gather=overlap, **units)
        _train(model, opt, 1)
        del opt
        left = _hook_count(model) - hooks_before
        if stage == 3:  # its parameters hold no values at rest: there is nothing to train again
            return left, None
        opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=stage,
                                           **units)
        before = [p.detach().clone() for p in model.parameters()]
        _train(model, opt, 1, start=1)
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    finally:
        gc.enable()
        hvd.barrier()
    return left, moved


def _hook_count(model):
    n = 0
    for m in model.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
        n += sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters(recurse=False))
    return n


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True), (3, False)])
def test_a_dropped_optimizer_lets_go_of_the_model_at_once(two_ranks, stage, overlap):
    for left, moved in two_ranks.run(_rewrapped, stage, overlap):
        assert left == 0, f"{left} hooks of the dropped optimizer are still on the model"
        assert moved is None or moved > 1e-3, moved  # the new optimizer trains
