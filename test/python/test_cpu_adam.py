"""The C++ CPU Adam (horovod_zero/torch/zero/offload/cpu_adam.py) against
torch.optim.Adam and AdamW's own (single-tensor) step.

Tolerance: torch's CPU sqrt (MKL) is not always correctly rounded and ours is, so
the param may differ by an ulp or two of itself; the moments are compared the
same way. _close: rtol 1e-6, atol 1e-7 times the largest magnitude of the
reference (a few fp32 ulps of the values compared)."""

import os

import pytest
import torch

from horovod_zero import _core
from horovod_zero.torch.zero.offload.cpu_adam import CpuAdam, adam_step_flat, chosen_isa, not_covered_reason
from horovod_zero.torch.zero.offload.overlap import backward_threads

def _supported(name):
    try:
        return _core.cpu_adam_isa(name) == name
    except ValueError:
        return False


ISAS = [name for name in ("scalar", "avx2", "avx512") if _supported(name)]


def _close(actual, expected):
    atol = 1e-7 * max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol)


def _pair(cls, init, groups_kw=None, **kw):
    """Two identical optimizers over copies of `init` (a list of tensors): one we
    step, one torch steps. groups_kw: one dict of hyperparameters per tensor."""
    params = [[torch.nn.Parameter(t.clone()) for t in init] for _ in range(2)]
    if groups_kw is None:
        return [(ps, cls(ps, **kw)) for ps in params]
    return [(ps, cls([dict(params=[p], **g) for p, g in zip(ps, groups_kw)], **kw)) for ps in params]


def _group_of(opt, p):
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def _our_step(opt, params, grads, outs=None, grad_scale=1.0, cpu_adam=None):
    cpu_adam = cpu_adam or CpuAdam(opt)
    outs = outs or [None] * len(params)
    cpu_adam.step_items([(_group_of(opt, p), p, g, o) for p, g, o in zip(params, grads, outs)], grad_scale=grad_scale)


def _torch_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.float().clone()
    opt.step()


def _expect_same_state(ours, ref):
    (pa, oa), (pb, ob) = ours, ref
    for a, b in zip(pa, pb):
        _close(a.detach(), b.detach())
        sa, sb = oa.state[a], ob.state[b]
        assert list(sa) == list(sb) == ["step", "exp_avg", "exp_avg_sq"]
        assert sa["step"].dtype == sb["step"].dtype and sa["step"].shape == sb["step"].shape == ()
        assert sa["step"].item() == sb["step"].item()
        _close(sa["exp_avg"], sb["exp_avg"])
        _close(sa["exp_avg_sq"], sb["exp_avg_sq"])


CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    (torch.optim.AdamW, dict(lr=torch.tensor(3e-3), betas=(0.3, 0.9), eps=1e-4, weight_decay=0.05)),
]


@pytest.mark.parametrize("cls,kw", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
def test_matches_torch_over_several_steps_at_odd_lengths(cls, kw):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen) for n in (1, 7, 16, 17, 33, 1037)]
    ours, ref = _pair(cls, init, **kw)
    cpu_adam = CpuAdam(ours[1])
    for _ in range(4):
        grads = [torch.randn(t.numel(), generator=gen) for t in init]
        _our_step(ours[1], ours[0], grads, cpu_adam=cpu_adam)
        _torch_step(ref[1], ref[0], grads)
    _expect_same_state(ours, ref)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_grads_and_param_copies(grad_dtype, out_dtype):
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(n, generator=gen) for n in (5, 1000)]
    ours, ref = _pair(torch.optim.AdamW, init, lr=1e-2)
    outs = [torch.full((t.numel(),), float("nan"), dtype=out_dtype) for t in init]
    for _ in range(3):
        grads = [torch.randn(t.numel(), generator=gen).to(grad_dtype) for t in init]
        _our_step(ours[1], ours[0], grads, outs=outs)
        _torch_step(ref[1], ref[0], grads)  # on grad.float()
    _expect_same_state(ours, ref)
    for p, o in zip(ours[0], outs):
        assert torch.equal(o, p.detach().to(out_dtype))  # the copy is the new param, rounded as .to() rounds


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_grad_scale_multiplies_the_gradient(cls):
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(300, generator=gen)]
    ours, ref = _pair(cls, init, lr=1e-2, weight_decay=0.1)
    for scale in (1 / 1024, 0.37, 3.0):
        grads = [torch.randn(300, generator=gen).to(torch.bfloat16)]
        _our_step(ours[1], ours[0], grads, grad_scale=scale)
        _torch_step(ref[1], ref[0], [g.float() * scale for g in grads])
    _expect_same_state(ours, ref)


def test_param_groups_keep_their_own_hyperparameters():
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=gen) for n in (50, 51, 52)]
    groups = [dict(lr=1e-2, weight_decay=0.0), dict(lr=torch.tensor(5e-3), betas=(0.5, 0.99), weight_decay=0.2),
              dict(lr=2e-2, eps=1e-3, maximize=True)]
    ours, ref = _pair(torch.optim.AdamW, init, groups_kw=groups)
    for _ in range(3):
        grads = [torch.randn(t.numel(), generator=gen) for t in init]
        _our_step(ours[1], ours[0], grads)
        _torch_step(ref[1], ref[0], grads)
    _expect_same_state(ours, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_of_this_cpu_matches_torch_and_the_scalar_kernel_bit_for_bit(isa):
    gen = torch.Generator().manual_seed(4)
    init = torch.randn(1037, generator=gen)
    grads = [torch.randn(1037, generator=gen).to(torch.bfloat16) for _ in range(3)]
    runs = {}
    for name in ("scalar", isa):
        ours, _ = _pair(torch.optim.AdamW, [init], lr=1e-2, weight_decay=0.01)
        cpu_adam = CpuAdam(ours[1], env={"HOROVOD_ZERO_CPU_ADAM_ISA": name})
        assert cpu_adam.isa == name
        out = torch.empty(1037, dtype=torch.bfloat16)
        for g in grads:
            _our_step(ours[1], ours[0], [g], outs=[out], cpu_adam=cpu_adam)
        runs[name] = (ours, out)
    _, ref = _pair(torch.optim.AdamW, [init], lr=1e-2, weight_decay=0.01)
    for g in grads:
        _torch_step(ref[1], ref[0], [g])
    _expect_same_state(runs[isa][0], ref)
    assert torch.equal(runs[isa][0][0][0], runs["scalar"][0][0][0])
    assert torch.equal(runs[isa][1], runs["scalar"][1])


def test_isa_setting():
    assert chosen_isa({}) == ISAS[-1]  # the widest this CPU has
    assert chosen_isa({"HOROVOD_ZERO_CPU_ADAM_ISA": "SCALAR"}) == "scalar"
    with pytest.raises(ValueError, match="HOROVOD_ZERO_CPU_ADAM_ISA='sse'"):
        chosen_isa({"HOROVOD_ZERO_CPU_ADAM_ISA": "sse"})
    for name in {"avx2", "avx512"} - set(ISAS):  # only where this CPU lacks one
        with pytest.raises(ValueError, match="not supported by this CPU"):
            chosen_isa({"HOROVOD_ZERO_CPU_ADAM_ISA": name})


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_give_the_same_result(threads):
    gen = torch.Generator().manual_seed(5)
    n = 100_003  # several blocks, and a tail
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.float16)
    ours, ref = _pair(torch.optim.AdamW, [init], lr=1e-2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _our_step(ours[1], ours[0], [grad])
    finally:
        torch.set_num_threads(before)
    one = _pair(torch.optim.AdamW, [init], lr=1e-2)[0]
    torch.set_num_threads(1)
    try:
        _our_step(one[1], one[0], [grad])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours[0][0], one[0][0])
    _torch_step(ref[1], ref[0], [grad])
    _expect_same_state(ours, ref)


@pytest.mark.parametrize("threads", [1, 3, 7])
def test_explicit_thread_counts_give_the_same_result(threads):
    """threads=k (the step beside backward) splits the blocks its own way: same bits."""
    gen = torch.Generator().manual_seed(6)
    n = 300_007  # 74 blocks of 4096: up to 9 threads get work, the last one a tail
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for k in (0, threads):
        p, m, v, out = param.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            adam_step_flat(p, grad, m, v, out, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, step=step,
                           decoupled=True, threads=k)
        results.append((p, m, v, out))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], param)  # it stepped


def test_state_dict_and_torch_steps_interchange_with_ours():
    """Ours, torch's and ours again on one optimizer, through a state_dict round
    trip, equal a pure-torch run."""
    gen = torch.Generator().manual_seed(6)
    init = [torch.randn(n, generator=gen) for n in (9, 40)]
    grads = [[torch.randn(t.numel(), generator=gen) for t in init] for _ in range(5)]
    mixed, ref = _pair(torch.optim.AdamW, init, lr=1e-2, weight_decay=0.01)
    for g in grads:
        _torch_step(ref[1], ref[0], g)
    params, opt = mixed
    _our_step(opt, params, grads[0])
    _torch_step(opt, params, grads[1])  # torch continues from our state
    _our_step(opt, params, grads[2])
    saved = opt.state_dict()
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = torch.optim.AdamW(params2, lr=1e-2, weight_decay=0.01)
    opt2.load_state_dict(saved)
    _our_step(opt2, params2, grads[3])  # ours continues from a loaded state
    _torch_step(opt2, params2, grads[4])
    _expect_same_state((params2, opt2), ref)


def test_adam_step_flat_is_the_same_step_on_bare_tensors():
    gen = torch.Generator().manual_seed(7)
    init, grad = torch.randn(77, generator=gen), torch.randn(77, generator=gen)
    _, ref = _pair(torch.optim.Adam, [init], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    _torch_step(ref[1], ref[0], [grad])
    _torch_step(ref[1], ref[0], [grad])
    param, m, v, out = init.clone(), torch.zeros(77), torch.zeros(77), torch.empty(77, dtype=torch.float16)
    for step in (1, 2):
        adam_step_flat(param, grad, m, v, out, lr=1e-2, betas=(0.8, 0.95),
                       eps=1e-6, weight_decay=0.1, step=step, decoupled=False)
    state = ref[1].state[ref[0][0]]
    _close(param, ref[0][0].detach())
    _close(m, state["exp_avg"])
    _close(v, state["exp_avg_sq"])
    assert torch.equal(out, param.half())


class _MyAdamW(torch.optim.AdamW):
    pass


def test_not_covered_reason():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for opt in (torch.optim.Adam(p), torch.optim.AdamW(p), torch.optim.AdamW(p, lr=torch.tensor(0.01)),
                torch.optim.Adam(p, foreach=True), torch.optim.AdamW(p, fused=True),
                torch.optim.Adam(p, decoupled_weight_decay=True)):
        assert not_covered_reason(opt) is None, opt
    assert not_covered_reason(torch.optim.SGD(p, lr=0.1)) == \
        "SGD is not covered by the C++ CPU Adam (only torch.optim.Adam and AdamW are)"
    assert "_MyAdamW is not covered" in not_covered_reason(_MyAdamW(p))
    assert "amsgrad=True (param group 0)" in not_covered_reason(torch.optim.AdamW(p, amsgrad=True))
    assert "differentiable=True" in not_covered_reason(torch.optim.Adam(p, differentiable=True))
    assert "capturable=True" in not_covered_reason(torch.optim.Adam(p, capturable=True))
    assert "betas given as tensors" in not_covered_reason(
        torch.optim.Adam(p, betas=(torch.tensor(0.9), torch.tensor(0.99))))
    opt = torch.optim.AdamW([dict(params=p[:1]), dict(params=[torch.nn.Parameter(torch.zeros(2))], amsgrad=True)])
    assert "(param group 1)" in not_covered_reason(opt)
    with pytest.raises(ValueError, match="amsgrad=True"):
        CpuAdam(opt)


def test_bad_input_is_refused_with_what_to_do():
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.AdamW([p])
    cpu_adam = CpuAdam(opt)
    group = opt.param_groups[0]
    cases = [
        ((group, p, torch.zeros(8, dtype=torch.float64), None), "grad is Double; it must be float32, bfloat16"),
        ((group, p, torch.zeros(7), None), "grad has 7 elements and param 8"),
        ((group, p, torch.zeros(16)[::2], None), "grad is not contiguous; pass grad.contiguous()"),
        ((group, p, torch.zeros(8, device="meta"), None), "grad is on meta; the CPU Adam steps dense CPU tensors"),
        ((group, p, torch.zeros(8), torch.zeros(8, dtype=torch.int32)), "out is Int"),
        ((group, p, torch.zeros(8), p.detach()), "param and out share memory"),
        ((dict(group), p, torch.zeros(8), None), "not in the param group given with it"),
        ((group, p, None, None), "has no gradient"),
    ]
    for item, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            cpu_adam.step_items([item])
    assert opt.state[p]["step"].item() == 0  # nothing stepped
    assert torch.equal(p.detach(), torch.zeros(8))
    with pytest.raises(ValueError, match="steps count from 1"):
        adam_step_flat(p.detach(), torch.zeros(8), torch.zeros(8), torch.zeros(8), None, lr=1e-3, betas=(0.9, 0.999),
                       eps=1e-8, weight_decay=0.0, step=0, decoupled=True)


def test_overlap_step_threads_setting():
    assert backward_threads({"HOROVOD_ZERO_OVERLAP_STEP_THREADS": "3"}) == 3
    assert backward_threads({}) == max(1, len(os.sched_getaffinity(0)) - 2)
    with pytest.raises(ValueError, match="HOROVOD_ZERO_OVERLAP_STEP_THREADS='-1'"):
        backward_threads({"HOROVOD_ZERO_OVERLAP_STEP_THREADS": "-1"})


def test_batch_steps_each_item_as_one_call_would_and_counts_the_steps():
    gen = torch.Generator().manual_seed(7)
    sizes = (5, 4096 * 3 + 1, 70_001)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
    singles = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty(p.numel(), dtype=torch.bfloat16))
               for p in params]
    batch = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty(p.numel(), dtype=torch.bfloat16))
             for p in params]
    counts = [torch.tensor(0.0), torch.tensor(3.0, dtype=torch.float64), torch.tensor(0.0)]
    for (p, m, v, out), g, c in zip(singles, grads, counts):
        adam_step_flat(p, g, m, v, out, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                       step=int(c.item()) + 1, decoupled=True)
    _core.cpu_adam_step_batch([(p, g, m, v, out, 1e-2, 0.9, 0.99, 1e-8, 0.1, c, True, False, 1.0)
                               for (p, m, v, out), g, c in zip(batch, grads, counts)], "auto", 2)
    for a, b in zip(singles, batch):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert [c.item() for c in counts] == [1.0, 4.0, 1.0]
    # A bad item anywhere: nothing is stepped, no count moves.
    before = [t.clone() for t in batch[0]]
    with pytest.raises(ValueError, match="elements"):
        _core.cpu_adam_step_batch([(batch[0][0], grads[0], *batch[0][1:3], None, 1e-2, 0.9, 0.99, 1e-8, 0.1,
                                    counts[0], True, False, 1.0),
                                   (batch[1][0], grads[2], *batch[1][1:3], None, 1e-2, 0.9, 0.99, 1e-8, 0.1,
                                    counts[1], True, False, 1.0)], "auto", 0)
    assert all(torch.equal(x, y) for x, y in zip(before, batch[0]))
    assert [c.item() for c in counts] == [1.0, 4.0, 1.0]
