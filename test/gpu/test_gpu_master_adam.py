"""The CUDA Adam/AdamW that steps fp32 master shards from bf16/fp16/fp32 gradients
(_core.master_adam_step, csrc/cuda/master_adam.cu) against torch's fused kernel stepping
the same gradients cast to fp32: equal to fp32 rounding over several steps, for sizes
that are and are not multiples of its 4-wide loads, offsets that break their alignment,
every hyperparameter it takes, and more tensors than one launch holds."""

import pytest
import torch

from horovod_zero import _core

pytestmark = pytest.mark.gpu


def _tensors(sizes, offset, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(n, scale):  # a view `offset` elements into its storage: unaligned when offset % 4
        return (torch.randn(n + offset, generator=g, device="cuda") * scale)[offset:]
    return [make(n, 1.0) for n in sizes], [make(n, 1e-2) for n in sizes]


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("decoupled,maximize,weight_decay,grad_scale,offset", [
    (True, False, 0.1, 1.0, 0), (False, False, 0.1, 0.5, 0), (False, True, 0.0, 1.0, 1), (True, True, 0.01, 2.0, 3)])
def test_master_adam_matches_torchs_fused_adam_on_the_cast_gradients(grad_dtype, decoupled, maximize, weight_decay,
                                                                      grad_scale, offset):
    sizes = [1, 3, 4, 17, 1000, 4099, 1 << 20] + [5] * 40  # 47 tensors: two launches
    params, _ = _tensors(sizes, offset, 0)
    ref = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    m_ref, v_ref = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device="cuda") for _ in params]
    steps_ref = [torch.zeros((), device="cuda") for _ in params]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for k in range(5):
        _, grads = _tensors(sizes, offset, 100 + k)
        grads = [g.to(grad_dtype) for g in grads]
        _core.master_adam_step(params, grads, m, v, steps, **hyper, decoupled=decoupled, maximize=maximize,
                               grad_scale=grad_scale, add_step=True)
        torch._foreach_add_(steps_ref, 1)
        fused(ref, [g.float() * grad_scale for g in grads], m_ref, v_ref, [], steps_ref, amsgrad=False,
              maximize=maximize, **hyper)
    for got, want in zip(params + m + v, ref + m_ref + v_ref):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert not torch.equal(params[-1], _tensors(sizes, offset, 0)[0][-1])  # it stepped


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_master_adam_copies_are_the_new_params_cast_as_the_gather_casts(copy_dtype, offset):
    """Each copy is its param after the step, rounded to nearest even: bit for bit what
    the gather's cast of the master makes (the gather then reads the copy instead)."""
    sizes = [1, 3, 4, 17, 4099, 1 << 20] + [5] * 40
    params, _ = _tensors(sizes, offset, 0)
    copies = [torch.full((n + offset,), float("nan"), device="cuda", dtype=copy_dtype)[offset:] for n in sizes]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.ones((), device="cuda") for _ in params]
    _, grads = _tensors(sizes, offset, 7)
    _core.master_adam_step(params, [g.bfloat16() for g in grads], m, v, steps, lr=1e-3, beta1=0.9, beta2=0.95,
                           eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False, grad_scale=0.5, copies=copies)
    for p, c in zip(params, copies):
        assert torch.equal(c, p.to(copy_dtype)), (p.numel(), (c.float() - p).abs().max())
    with pytest.raises(ValueError, match="one per param"):
        _core.master_adam_step(params, grads, m, v, steps, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                               weight_decay=0.0, decoupled=True, maximize=False, grad_scale=1.0, copies=copies[:1])
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        _core.master_adam_step(params, grads, m, v, steps, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                               weight_decay=0.0, decoupled=True, maximize=False, grad_scale=1.0,
                               copies=[p.clone() for p in params])


def test_master_adam_names_what_is_wrong():
    p = torch.zeros(8, device="cuda")
    ok = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False,
              grad_scale=1.0)
    step = torch.ones((), device="cuda")
    with pytest.raises(ValueError, match="same length"):
        _core.master_adam_step([p], [], [p.clone()], [p.clone()], [step], **ok)
    with pytest.raises(ValueError, match="float32"):
        _core.master_adam_step([p.half()], [p.half()], [p.clone()], [p.clone()], [step], **ok)
    with pytest.raises(ValueError, match="contiguous"):
        _core.master_adam_step([p], [torch.zeros(16, device="cuda")[::2]], [p.clone()], [p.clone()], [step], **ok)
    with pytest.raises(ValueError, match="CUDA"):
        _core.master_adam_step([p.cpu()], [p.cpu()], [p.cpu()], [p.cpu()], [step.cpu()], **ok)
    # A refusal found at the last tensor leaves every step count as it was.
    q = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match=r"contiguous.*\(tensor 1\)"):
        _core.master_adam_step([q, p], [q.clone(), torch.zeros(16, device="cuda")[::2]], [q.clone(), p.clone()],
                               [q.clone(), p.clone()], [step, step.clone()], **ok, add_step=True)
    assert step.item() == 1.0


def test_master_adam_refusal_says_how_to_step_without_it():
    from horovod_zero.torch.zero.core import master_adam
    p = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    master_adam.step(opt, opt.param_groups[0], [p], [torch.ones(8, device="cuda", dtype=torch.bfloat16)])
    assert opt.state[p]["step"].item() == 1.0 and p.abs().sum() > 0
    with pytest.raises(ValueError, match="HOROVOD_ZERO_MASTER_ADAM=0"):
        master_adam.step(opt, opt.param_groups[0], [p], [torch.ones(4, device="cuda", dtype=torch.bfloat16)])
    assert opt.state[p]["step"].item() == 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_master_adam_runs_on_the_tensors_device_whatever_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current: the step is queued on cuda:1's stream,
    behind the work that made its gradients (a launch on cuda:0 would race it)."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    p = torch.randn(1 << 22, device=dev)
    ref, m, v, m_ref, v_ref = p.clone(), *[torch.zeros_like(p) for _ in range(4)]
    steps, steps_ref = torch.ones((), device=dev), torch.ones((), device=dev)
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(3):
        g = (a @ a).flatten()[:p.numel()].mul_(1e-3)  # made on cuda:1's stream just before the step
        _core.master_adam_step([p], [g], [m], [v], [steps], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.0, decoupled=True, maximize=False, grad_scale=1.0)
        torch._fused_adamw_([ref], [g], [m_ref], [v_ref], [], [steps_ref], amsgrad=False, maximize=False,
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        torch._foreach_add_([steps, steps_ref], 1)
    torch.testing.assert_close(p, ref, rtol=2e-6, atol=1e-7)
