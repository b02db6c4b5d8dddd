"""device=: a model built on the host, wrapped to train on another device, against the
single-process torch reference. The model has a buffer and a frozen parameter that the
optimizer does not hold, which must move too. On this CPU-only machine the target is the
host itself (the move is a no-op) and CUDA targets are refused; the GPU tests
(test/gpu/test_gpu_offload.py) run the same worker with a CUDA target."""

import pytest
import torch

import horovod_zero.torch as hvd
from refs import batch, mlp, mse, rank_rows, rel_err, train_reference

STEPS = 4


class WithBuffer(torch.nn.Module):
    """refs.mlp, then a scale held in a buffer and a frozen shift."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
        self.shift = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 7), requires_grad=False)

    def forward(self, x):
        return self.net(x) * self.scale + self.shift


def _inner(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _host_built(stage, options):
    """(max relative error against torch, the devices of every tensor of the model after
    wrapping, the training device)."""
    model = WithBuffer()  # on the host
    target = hvd.device()
    opt = hvd.DistributedZeroOptimizer(_inner(model), model=model, stage=stage, device=target,
                                       units=[torch.nn.Linear] if stage == 3 else None, **options)
    placed = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    n, r = hvd.size(), hvd.rank()
    for step in range(STEPS):
        x, y = batch(step, 0, target)
        mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    ref_model = WithBuffer()
    train_reference(1, None, steps=STEPS, model=ref_model, opt=_inner(ref_model))
    if stage == 3:
        with opt.gathered_params():
            ours = [p.detach().double().cpu().clone() for p in model.parameters()]
    else:
        ours = [p.detach().double().cpu().clone() for p in model.parameters()]
    err = max(rel_err(p, q) for p, q in zip(ours, ref_model.parameters()))
    return err, placed, str(torch.device(target))


@pytest.mark.parametrize("stage,options", [(1, {}), (2, {}), (3, {}), (2, {"offload_optimizer": "cpu"}),
                                           (3, {"offload_optimizer": "cpu", "offload_params": "cpu"})],
                         ids=["stage1", "stage2", "stage3", "stage2-offload", "stage3-offload-params"])
def test_host_built_model_wrapped_with_device_matches_torch(ranks, stage, options):
    for err, placed, target in ranks.run(_host_built, stage, options):
        assert err < 1e-5, err
        assert placed == {target}, placed


def _without_model():
    """device= naming where the parameters already are needs no model=."""
    model = mlp()
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), device=hvd.device())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, 0, hvd.device())
    mse(model, x, y).backward()
    opt.step()
    return all(bool((p != q).any()) for p, q in zip(model.parameters(), before))


def test_device_where_the_parameters_are_needs_no_model(ranks):
    assert all(ranks.run(_without_model))


def _bad_devices():
    errors = {}
    for key, device in {"tpu": "xla", "nonsense": "not-a-device", "cuda": "cuda"}.items():
        if key == "cuda" and torch.cuda.is_available():
            continue
        model = WithBuffer()
        try:
            hvd.DistributedZeroOptimizer(_inner(model), model=model, device=device)
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    return errors


def test_device_errors_say_what_to_do(ranks):
    for errors in ranks.run(_bad_devices):
        assert "trains on CUDA GPUs or the CPU" in errors["tpu"], errors
        assert "is not a device: pass hvd.device()" in errors["nonsense"], errors
        if "cuda" in errors:
            assert "no usable CUDA GPU" in errors["cuda"] and "device=hvd.device()" in errors["cuda"], errors
