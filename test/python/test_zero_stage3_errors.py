"""ZeRO stage 3 misuse, each refused with what to do (or recovered from), and the
precisions: bf16 with clipping and fp16 with loss scaling, against torch. 2 CPU ranks."""

import pytest
import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from harness import shared_pool
from test_zero_misuse import _error
from test_zero_stage3 import Block, Net, adamw, batch, local, loss_of, reference, rel_errors, train


@pytest.fixture
def two_ranks():
    return shared_pool(2)


def _wrap_errors():
    def wrap(net, **kw):
        return hvd.DistributedZeroOptimizer(adamw(net), stage=3, **kw)
    net = Net()
    return {
        "no_model": _error(lambda: wrap(net, named_parameters=list(net.named_parameters()))),
        "two_units": _error(lambda: wrap(net, model=net, units=[net.blocks, net.blocks[0]])),
        "nested": _error(lambda: wrap(net, model=net, units=[Block, torch.nn.Linear])),
        "units_stage2": _error(lambda: hvd.DistributedZeroOptimizer(adamw(net), model=net, units=[Block])),
        "unchanged": [p.numel() for p in net.parameters()] == [p.numel() for p in Net().parameters()],
    }


def test_bad_stage3_arguments_are_refused_before_anything_changes(two_ranks):
    for msgs in two_ranks.run(_wrap_errors):
        assert "needs model=" in msgs["no_model"], msgs
        assert "in two units" in msgs["two_units"] and "blocks.0" in msgs["two_units"], msgs
        assert "in two units" in msgs["nested"], msgs
        assert "units= is for stage=3" in msgs["units_stage2"], msgs
        assert msgs["unchanged"], "a refused wrap resharded the model"


def _replaced(kind):
    model = Net()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)
    if kind == "parameter":
        model.blocks[1].up.weight = torch.nn.Parameter(torch.zeros(14, 10))
    else:
        model.half()
    ids, target = batch(0)

    def step():
        loss_of(model, local(ids), local(target), 0).float().backward()
        opt.step()
    return _error(step)


@pytest.mark.parametrize("kind,fragment", [("parameter", "before building and wrapping"), ("half", "param_dtype=")])
def test_parameters_replaced_after_wrapping_are_refused_by_name(two_ranks, kind, fragment):
    for msg in two_ranks.run(_replaced, kind):
        assert msg is not None and fragment in msg, msg
        assert "blocks.1.up.weight" in msg or "emb.weight" in msg, msg


def _resharded_use():
    model = Net()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)  # its hooks live as long as it
    x = torch.randn(2, 10)
    msg = _error(lambda: model.blocks[0].up(x))
    with opt.gathered_params():
        inside = _error(lambda: model.blocks[0].up(x))
    return model.blocks[0].up.weight.numel(), msg, inside


def test_a_resharded_parameter_cannot_be_used_with_stale_values(two_ranks):
    for numel, msg, inside in two_ranks.run(_resharded_use):
        assert inside is None, inside
        assert numel == 0
        assert msg is not None, "a layer ran on a parameter that is not gathered"
        assert "'blocks.0.up' ran while its gather unit 'blocks.0' is sharded" in msg and "gathered_params" in msg, msg


def _forward_raises():
    model = Net()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)
    ids, target = batch(0)
    def broken_forward():
        hook = model.blocks[2].register_forward_pre_hook(lambda *_: 1 / 0)
        try:
            loss_of(model, local(ids), local(target), 0).backward()
        finally:
            hook.remove()
    first = _error(broken_forward)
    msg = _error(opt.step)
    opt.zero_grad()  # frees what the broken forward left gathered
    train(model, opt, steps=2)
    with opt.gathered_params():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return first, msg, rel_errors(params, reference(steps=2))


def test_a_step_after_a_forward_that_raised_says_what_to_do(two_ranks):
    for first, msg, errs in two_ranks.run(_forward_raises):
        assert first is not None and "ZeroDivisionError" in first, first
        assert msg is not None and "still gathered" in msg and "zero_grad()" in msg, msg
        assert max(errs.values()) < 1e-6, errs


def _rank0_only():
    model = Net()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)
    train(model, opt, steps=2)
    with opt.gathered_params(rank0_only=True):
        numels = [p.numel() for p in model.parameters()]
        errs = rel_errors(dict(model.named_parameters()), reference(steps=2)) if hvd.rank() == 0 else None
    return numels, errs, [p.numel() for p in model.parameters()]


def test_gathered_params_on_rank_0_only(two_ranks):
    full = [p.numel() for p in Net().parameters()]
    for r, (numels, errs, after) in enumerate(two_ranks.run(_rank0_only)):
        assert numels == (full if r == 0 else [0] * len(full)), numels
        assert after == [0] * len(full)
        if r == 0:
            assert max(errs.values()) < 1e-6, errs


# --- precisions -------------------------------------------------------------------------------

def _bf16_clip(clip):
    model = Net()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3, param_dtype=torch.bfloat16)
    norms = []
    for step in range(3):
        ids, target = batch(10 * step)
        loss_of(model, local(ids), local(target), step).float().backward()
        norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        params = {n: p.detach().float() for n, p in model.named_parameters()}
        dtypes = {p.dtype for p in model.parameters()}
    # Reference: fp32 master weights stepped with the gradients of a bf16 copy on the whole batch.
    master = Net()
    ref_opt = adamw(master)
    work = Net().bfloat16()
    ref_norms = []
    for step in range(3):
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
        work.zero_grad()
        ids, target = batch(10 * step)
        loss_of(work, ids, target, step).float().backward()
        for w, m in zip(work.parameters(), master.parameters()):
            m.grad = None if w.grad is None else w.grad.float()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), clip)))
        ref_opt.step()
    return rel_errors(params, master), norms, ref_norms, dtypes


def test_bf16_with_clipping_tracks_fp32_master_weights(two_ranks):
    for errs, norms, ref_norms, dtypes in two_ranks.run(_bf16_clip, 0.5):
        assert dtypes == {torch.bfloat16}
        assert max(errs.values()) < 2e-2, errs  # bf16 rounding of the gathered weights and reduced gradients
        assert all(abs(a - b) < 2e-2 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        assert min(ref_norms) > 0.5, ref_norms  # so the clip acted


def _fp16_overflow():
    model = Net()
    # A small scale: this model's fp16 gradients, summed over ranks on the wire, overflow at 2**15.
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=3,
                                       param_dtype=torch.float16, loss_scaler=hvd.zero.LossScaler(scale=256.0))
    scale0 = opt.loss_scaler.scale
    ids, target = batch(0)
    loss = loss_of(model, local(ids), local(target), 0).float()
    opt.scale_loss(loss * (1e9 if hvd.rank() == 1 else 1.0)).backward()  # overflows on rank 1 only
    opt.step()
    opt.zero_grad()
    with opt.gathered_params():
        skipped = all(torch.equal(p, q.half()) for p, q in zip(model.parameters(), Net().parameters()))
    ids, target = batch(1)
    opt.scale_loss(loss_of(model, local(ids), local(target), 1).float()).backward()
    opt.step()
    with opt.gathered_params():
        params = {n: p.detach().float() for n, p in model.named_parameters()}
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids, target = batch(1)
    loss_of(ref, ids, target, 1).backward()
    ref_opt.step()
    return skipped, scale0, opt.loss_scaler.scale, rel_errors(params, ref)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(two_ranks):
    for skipped, scale0, scale1, errs in two_ranks.run(_fp16_overflow):
        assert skipped and scale1 == scale0 * 0.5
        assert max(errs.values()) < 5e-3, errs


def _add_group_later(zero):
    """Block 2 frozen and outside the optimizer for 2 steps, then added with its own lr."""
    model = Net()
    model.blocks[2].requires_grad_(False)
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.2.")]
    inner = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    opt = hvd.DistributedZeroOptimizer(inner, model=model, stage=3) if zero else inner
    steps = (lambda start: train(model, opt, steps=2, start=start)) if zero else \
        (lambda start: _train_whole(model, opt, start))
    steps(0)
    model.blocks[2].requires_grad_(True)
    opt.add_param_group({"params": list(model.blocks[2].parameters()), "lr": 5e-3, "weight_decay": 0.0})
    steps(2)
    if not zero:
        return dict(model.named_parameters())
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_whole(model, opt, start):
    for step in range(start, start + 2):
        ids, target = batch(10 * step)
        loss_of(model, ids, target, step).backward()
        opt.step()
        opt.zero_grad()


def _added_group():
    got, want = _add_group_later(True), _add_group_later(False)
    return max(float((got[n].double() - w.detach().double()).norm() / w.detach().double().norm())
               for n, w in want.items())


def test_add_param_group_at_stage3_shards_and_gathers_the_new_group(two_ranks):
    for err in two_ranks.run(_added_group):
        assert err < 1e-6, err
